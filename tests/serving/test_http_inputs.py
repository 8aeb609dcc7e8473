"""Every input the HTTP API refuses gets a clear 4xx that names what is wrong, and the server keeps serving: one
real server on 127.0.0.1 (the tiny checkpoint) for the module, raw HTTP so that nothing is shaped by a client."""
import json

import httpx
import openai
import pytest

from nanovllm_tp.serving.protocol import REFUSED_FIELDS
from tests.serving.test_serve import served

pytestmark = pytest.mark.spawn

MAX_MODEL_LEN = 256
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def url(tiny_model_dir):
    with served(tiny_model_dir, "--max-model-len", str(MAX_MODEL_LEN)) as base:
        yield base


def post(url: str, path: str, body=None, raw: bytes | None = None, content_type: str | None = "application/json"):
    headers = {"Content-Type": content_type} if content_type else {}
    return httpx.post(url + path, content=raw if raw is not None else json.dumps(body), headers=headers, timeout=60)


def refused(r: httpx.Response, *words: str, status: int = 400, param: str | None = None) -> dict:
    """An OpenAI error object with this status whose message holds every word (and names param, if given)."""
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["code"] == status and isinstance(error["type"], str), error
    assert all(w in error["message"] for w in words), error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def complete(url: str, **kw) -> str:
    r = post(url, "/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**400}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2**70]}, "prompt.1"),
    ("/v1/completions", {"prompt": [[1], [3, -2**64]]}, "prompt.1.1"),
    ("/v1/completions", {"prompt": "x", "n": 10**20}, "n"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(2**64): 1}}, f"logit_bias.{2**64}.[key]"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": -2**64}, "seed"),
    ("/v1/chat/completions", {"messages": CHAT, "stop_token_ids": [2**63]}, "stop_token_ids.0"),
])
def test_integers_beyond_64_bits_get_a_400_naming_the_field(url, path, body, param):
    """They used to reach the messages between the server's processes and come back as 500s."""
    refused(post(url, path, body), "must be an integer in [-2**63, 2**63)", param=param)


def test_a_body_with_an_integer_of_5000_digits_gets_a_400(url):
    raw = b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"
    refused(post(url, "/v1/completions", raw=raw), "integer of more than 4300 digits")
    assert complete(url)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": "\ud800"}]}, "messages.0.name"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"note": ["\ud800"]}},
     "chat_template_kwargs.note.0"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": ["ok", "\ud800"]}, "stop.1"),
    ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "\ud800"]}, "prompt.1"),
    ("/v1/completions", {"prompt": "x", "stop": "\ud800"}, "stop"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["\ud800"]}, "bad_words.0"),
    ("/v1/completions", {"prompt": "x", "user": "\ud800"}, "user"),
    ("/v1/completions", {"prompt": "x", "\ud800": 1}, "\\ud800"),      # a key: named in ASCII
])
def test_a_lone_surrogate_in_any_text_field_gets_a_400_naming_it(url, path, body, param):
    refused(post(url, path, body), "not valid Unicode", param=param)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
    ({"prompt": [1, True]}, "prompt.1"),
    ({"prompt": [1, 1.0]}, "prompt.1"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "temperature": "0"}, "temperature"),
    ({"prompt": "x", "stop": [1]}, "stop.0"),
    ({"prompt": 17}, "prompt"),
])
def test_json_types_are_strict(url, body, param):
    """A bool is not an integer, nor is 2.0 (JSON numbers with a fraction); a string is not a number."""
    refused(post(url, "/v1/completions", body), param=param)
    assert complete(url, temperature=0) == complete(url, temperature=0.0)   # an integer is a number, though


@pytest.mark.parametrize("field", sorted(REFUSED_FIELDS))
def test_every_unimplemented_field_is_refused_by_name_on_both_endpoints(url, field):
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT})):
        refused(post(url, path, {**body, field: 1}), field, REFUSED_FIELDS[field], param=field)


def test_the_issue_s_silently_ignored_fields_are_refused_and_the_real_ones_work(url):
    # response_format and tools are implemented (tests/serving/test_structured_serve.py); their old spellings not
    r = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    refused(post(url, "/v1/chat/completions", {"messages": CHAT, "guided_json": {"type": "object"}}),
            "structured_outputs", param="guided_json")
    functions = [{"name": "f", "parameters": {"type": "object"}}]
    refused(post(url, "/v1/chat/completions", {"messages": CHAT, "functions": functions}), "tools",
            param="functions")
    refused(post(url, "/v1/completions", {"prompt": "x", "best_of": 2}), "best_of", param="best_of")
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    refused(post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": [image]}]}), "image",
            param="messages.0.content.0.image_url")
    # logit_bias is implemented: +100 on one token makes it every greedy token
    r = post(url, "/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0,
                                      "logit_bias": {"42": 100}, "logprobs": 0})
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 4 and len(set(tokens)) == 1 and r.json()["choices"][0]["text"] == tokens[0] * 4


def test_unknown_fields_are_refused_with_the_closest_known_one(url):
    refused(post(url, "/v1/completions", {"prompt": "x", "max_token": 5}), "unknown field", "'max_tokens'",
            param="max_token")
    refused(post(url, "/v1/chat/completions", {"messages": CHAT, "echo": True}), "not a field here", param="echo")
    refused(post(url, "/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usag": True}}),
            "'include_usage'", param="stream_options.include_usag")
    refused(post(url, "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}),
            "stream_options is only allowed with stream=true")
    # OpenAI's bookkeeping fields are accepted: they have no effect on the output; null is a field's default
    assert complete(url, user="u", metadata={"k": "v"}, store=False, service_tier="auto",
                    prompt_cache_key="p", safety_identifier="s") == complete(url)
    assert complete(url, n=None, stop=None, presence_penalty=None, stream=None, logit_bias=None, echo=None,
                    min_tokens=None, skip_special_tokens=None) == complete(url)
    refused(post(url, "/v1/completions", {"prompt": None}), "prompt: Field required", param="prompt")
    # an assistant message as the openai client dumps it, and fields it does not set, sent as null
    turn = {"role": "assistant", "content": "Paris.", "refusal": None, "tool_calls": None, "audio": None}
    r = post(url, "/v1/chat/completions", {"messages": [*CHAT, turn, *CHAT], "max_tokens": 2, "tools": None})
    assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    first = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2).choices[0].message
    for previous in (first, first.model_dump()):           # the object itself, or every field of it
        again = client.chat.completions.create(model="tiny", max_tokens=2,
                                               messages=[*CHAT, previous, {"role": "user", "content": "And?"}])
        assert again.choices[0].finish_reason == "length"


def test_max_tokens_beyond_the_context_is_a_400_in_vllm_s_shape(url):
    """vLLM's server answers 400 when prompt + max_tokens exceed max_model_len; it used to run to the limit."""
    prompt = [5, 6, 7, 8]
    refused(post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 10**9}),
            f"maximum context length is {MAX_MODEL_LEN} tokens", f"{10**9 + 4}", "4 in the prompt",
            f"{10**9} in max_tokens")
    r = post(url, "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": MAX_MODEL_LEN})
    refused(r, f"maximum context length is {MAX_MODEL_LEN} tokens")
    # exactly the context fits, and runs to it
    r = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_MODEL_LEN - 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 4


def test_min_tokens_above_max_tokens_is_refused(url):
    refused(post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}),
            "min_tokens must be <= max_tokens=2")


def test_chat_template_kwargs_cannot_set_the_server_s_own_arguments(url):
    for key in ("add_generation_prompt", "tokenize", "return_dict"):     # chat_template: see test_limits
        error = refused(post(url, "/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {key: True}}),
                        f"chat_template_kwargs cannot set {key!r}")
        assert "multiple values" not in error["message"] and "TypeError" not in error["message"]
    r = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "chat_template_kwargs": {"x": 1}})
    assert r.status_code == 200      # a template variable passes


def test_chat_roles_are_the_five_known_ones(url):
    refused(post(url, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
            "'system', 'developer', 'user', 'assistant' or 'tool'", param="messages.0.role")
    for role in ("system", "developer", "user", "assistant", "tool"):
        r = post(url, "/v1/chat/completions", {"messages": [{"role": role, "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, (role, r.text)


def test_a_body_that_is_not_json_gets_415_or_a_400_that_says_so(url):
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    refused(post(url, "/v1/completions", raw=body, content_type="text/plain"), "Content-Type: application/json",
            "text/plain", status=415)
    refused(post(url, "/v1/completions", raw=body, content_type=None), "no Content-Type", status=415)
    assert post(url, "/v1/completions", raw=body, content_type="application/json; charset=utf-8").status_code == 200
    refused(post(url, "/v1/completions", raw=b'{"prompt": "x",'), "not valid JSON", param=None)
    refused(post(url, "/v1/completions", raw=b"[1, 2]"), "must be a JSON object")
    refused(post(url, "/v1/completions", raw=b"[" * 100_000 + b"]" * 100_000), "not readable JSON")
    refused(post(url, "/v1/completions", raw=b'{"prompt": "\xff"}'), "UTF-8")


def test_405_answers_carry_an_allow_header(url):
    r = httpx.get(url + "/v1/completions", timeout=10)
    refused(r, status=405)
    assert r.headers["allow"] == "POST"
    r = httpx.post(url + "/v1/models", timeout=10)
    assert r.status_code == 405 and "GET" in r.headers["allow"].split(", ")


def test_a_top_k_beyond_32_bits_is_off_and_the_engine_keeps_serving(url):
    """It used to stop the engine (every later request got 503)."""
    seeded = {"temperature": 1.0, "seed": 7, "max_tokens": 8}
    assert complete(url, top_k=2**62, **seeded) == complete(url, top_k=0, **seeded)
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_the_openapi_schema_declares_what_a_body_may_hold(url):
    schemas = httpx.get(url + "/openapi.json", timeout=30).json()["components"]["schemas"]
    completion = schemas["CompletionRequest"]
    assert completion["additionalProperties"] is False and "prompt" in completion["required"]
    declared = set(completion["properties"]) | set(schemas["ChatCompletionRequest"]["properties"])
    assert "logit_bias" in declared and not set(REFUSED_FIELDS) & declared
