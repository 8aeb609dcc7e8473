"""A property-based fuzz of the HTTP API. hypothesis draws requests around the declared request models (every
field, with valid values and hostile ones: wrong JSON types, integers past 64 bits, NaN, lone surrogates, fields
refused or unknown, bodies cut short, not JSON objects or not sent as JSON) and sends them to one real server on
127.0.0.1 (the tiny checkpoint). Every answer is a 2xx (a stream ending in [DONE]) or an OpenAI error object with a
4xx, never a 5xx or a dropped connection; afterwards the server's greedy answer is still transformers' and every
KV block is free again.

The quick form runs in the default suite; the long one (1,200 requests) is `slow`:

    python -m pytest tests/serving/test_http_fuzz.py -m slow -p no:cacheprovider
"""
import collections
import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from nanovllm_tp.serving.protocol import REFUSED_FIELDS, ChatCompletionRequest, CompletionRequest
from tests.helpers import hf_greedy
from tests.serving.test_serve import metrics, served

pytestmark = pytest.mark.spawn

MAX_MODEL_LEN = 96          # bounds every request's work: the fuzz is about answers, not long generations
VOCAB = 2003                # the tiny checkpoint's (make_tiny)
GREEDY_PROMPT = [11, 220, 37, 5, 902, 64]

INTS = st.sampled_from([2**63, -2**63 - 1, 2**64, 10**30, 10**400, 0, -1, 2**31, 2**63 - 1])
# no subnormal floats: once the C kernels (built with -ffast-math) are loaded in this process, they flush to zero
# and hypothesis refuses to draw them
FLOATS = st.floats(allow_subnormal=False) | st.sampled_from([0.0, 0.5, 1.0, 2.0, 1e-300, 3.5e38])
TEXT = st.text(st.characters() | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=12)
HOSTILE = INTS | TEXT | FLOATS | st.booleans() | st.none() | st.recursive(
    st.none() | st.booleans() | INTS | FLOATS | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6)
WORDS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-2, 2, allow_subnormal=False) | WORDS,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(WORDS, inner, max_size=3),
                    max_leaves=4)
TOKEN = st.integers(0, VOCAB - 1)


def unit(lo: float, hi: float):
    return st.floats(lo, hi, allow_subnormal=False) | st.sampled_from([lo, hi])


# Each field's valid values (or nearly: combinations may still be refused); hostile ones come from HOSTILE.
SHARED = {
    "model": st.just("tiny"), "n": st.integers(1, 3),
    "temperature": unit(0.0, 2.0), "top_p": unit(0.05, 1.0), "min_p": unit(0.0, 1.0),
    "presence_penalty": unit(-2.0, 2.0), "frequency_penalty": unit(-2.0, 2.0), "repetition_penalty": unit(0.5, 2.0),
    "stop": WORDS | st.lists(WORDS, max_size=3),
    "seed": st.integers(0, 2**63 - 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logit_bias": st.dictionaries(TOKEN.map(str), unit(-100.0, 100.0), max_size=3),
    "user": WORDS, "metadata": st.dictionaries(WORDS, WORDS, max_size=2), "store": st.booleans(),
    "service_tier": WORDS, "prompt_cache_key": WORDS, "safety_identifier": WORDS,
    "top_k": st.integers(-1, 50) | st.just(2**62),
    "min_tokens": st.integers(0, 8),
    "ignore_eos": st.booleans(), "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "stop_token_ids": st.lists(TOKEN, max_size=4), "allowed_token_ids": st.lists(TOKEN, min_size=1, max_size=4),
    "stream_interval": st.integers(1, 5),
    "bad_words": st.lists(WORDS, max_size=2),
}
MAX_TOKENS = st.integers(1, 40) | st.none()
PART = st.fixed_dictionaries({"type": st.just("text"), "text": WORDS})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
                                optional={"content": WORDS | st.lists(PART, max_size=2) | st.none(), "name": WORDS})
FIELDS = {
    "/v1/completions": {
        **SHARED, "max_tokens": MAX_TOKENS, "logprobs": st.integers(0, 20) | st.none(), "echo": st.booleans(),
        "prompt": WORDS | st.lists(WORDS, min_size=1, max_size=3) | st.lists(TOKEN, min_size=1, max_size=8)
        | st.lists(st.lists(TOKEN, min_size=1, max_size=4), min_size=1, max_size=3)},
    "/v1/chat/completions": {
        **SHARED, "max_tokens": MAX_TOKENS, "max_completion_tokens": MAX_TOKENS, "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 20), "add_generation_prompt": st.booleans(),
        "messages": st.lists(MESSAGE, min_size=1, max_size=3),
        "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]), JSON, max_size=2)},
}
# never a valid n above 3 (it would be served: capping n is a server setting of its own)
HOSTILE_FOR = {"n": HOSTILE.filter(lambda v: not (type(v) is int and 3 < v < 2**63)),
               "messages": st.lists(st.fixed_dictionaries(
                   {"role": st.sampled_from(["user", "wizard"]) | HOSTILE},
                   optional={"content": HOSTILE | st.lists(st.fixed_dictionaries(
                       {"type": st.sampled_from(["text", "image_url"]) | HOSTILE, "text": HOSTILE}), max_size=2),
                       "tool_calls": HOSTILE, "extra": HOSTILE}), max_size=3)}
REQUIRED = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}
EXTRA_NAMES = st.sampled_from(sorted(REFUSED_FIELDS)) | TEXT


MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def fields_of(path: str) -> dict:
    """Every field the endpoint declares, with its valid values: from FIELDS, or any small JSON value for a field
    declared since (give it an entry there)."""
    return {name: FIELDS[path].get(name, JSON) for name in MODELS[path].model_fields}


def test_the_fuzz_draws_declared_fields_only():
    for path, model in MODELS.items():
        assert set(FIELDS[path]) <= set(model.model_fields)


def rarely(draw, one_in: int) -> bool:
    """True once in `one_in` draws (hypothesis draws small integers far more often than the others)."""
    return draw(st.sampled_from([False] * (one_in - 1) + [True]))


@st.composite
def requests(draw):
    """(path, body bytes, Content-Type, streamed): half the bodies valid field by field, the others with one or two
    hostile values, one in six with a field that is refused or unknown, one in eight mangled as a whole."""
    path = draw(st.sampled_from(sorted(FIELDS)))
    table = fields_of(path)
    names = draw(st.lists(st.sampled_from(sorted(table)), unique=True, max_size=6))
    if not rarely(draw, 20):
        names.insert(0, REQUIRED[path])
    body = {name: draw(table[name]) for name in names}
    if names and draw(st.booleans()):
        for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True)):
            body[name] = draw(HOSTILE_FOR.get(name, HOSTILE))
    if rarely(draw, 6):
        body[draw(EXTRA_NAMES)] = draw(HOSTILE)
    raw, content_type = json.dumps(body).encode(), "application/json"
    mangle = draw(st.sampled_from([None] * 21 + ["cut", "content type", "not an object"]))
    if mangle == "cut":
        raw = raw[:draw(st.integers(0, max(len(raw) - 1, 0)))]
    elif mangle == "content type":
        content_type = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", ""]))
    elif mangle == "not an object":
        raw = json.dumps(draw(HOSTILE)).encode()
    return path, raw, content_type, body.get("stream") is True


def send(http: httpx.Client, url: str, path: str, raw: bytes, content_type: str, streamed: bool) -> int:
    headers = {"Content-Type": content_type} if content_type else {}
    with http.stream("POST", url + path, content=raw, headers=headers) as r:
        text = r.read().decode()
    assert r.status_code < 500, (path, raw[:300], r.status_code, text[:500])
    if r.status_code >= 400:
        error = json.loads(text)["error"]
        assert error["code"] == r.status_code and isinstance(error["message"], str) and error["message"], text
        return r.status_code
    assert r.status_code == 200, text[:500]
    if not streamed:
        assert json.loads(text)["choices"], text[:500]
        return 200
    # SSE lines end at \n (not str.splitlines' \x85 or \u2028, which a text may hold)
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-500:]
    assert all("error" not in json.loads(e) for e in events[:-1]), text[-500:]
    return 200


@pytest.fixture(scope="module")
def url(tiny_model_dir):
    with served(tiny_model_dir, "--max-model-len", str(MAX_MODEL_LEN)) as base:
        yield base


@pytest.fixture(scope="module")
def greedy(url, hf_model, tiny_model_dir):
    """The server's greedy answer, checked against transformers' before the fuzz; returns how to ask again."""
    from transformers import AutoTokenizer
    want = AutoTokenizer.from_pretrained(tiny_model_dir).decode(hf_greedy(hf_model, GREEDY_PROMPT, 16))

    def ask() -> str:
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": GREEDY_PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "skip_special_tokens": False})
        return r.json()["choices"][0]["text"]
    assert ask() == want
    return ask, want


def fuzz(url: str, greedy, examples: int, derandomize: bool) -> None:
    ask, want = greedy
    statuses = collections.Counter()
    with httpx.Client(timeout=120) as http:
        @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(requests())
        def one(request):
            statuses[send(http, url, *request)] += 1
        one()
    print(f"{sum(statuses.values())} requests: {dict(sorted(statuses.items()))}")
    assert statuses[200] >= 0.1 * examples, statuses           # the engine served a share of them
    assert ask() == want
    deadline = time.monotonic() + 30           # every request answered: nothing runs, every block is free
    while (m := metrics(url.rsplit(":", 1)[1]))['num_requests_running{model_name="tiny"}'] and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert m['num_requests_running{model_name="tiny"}'] == 0 and m['kv_cache_usage_perc{model_name="tiny"}'] == 0


def test_fuzzed_requests_get_2xx_or_4xx_and_the_server_stays_exact(url, greedy):
    fuzz(url, greedy, 200, derandomize=True)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzzed_requests_long_form(url, greedy):
    fuzz(url, greedy, 1200, derandomize=False)
