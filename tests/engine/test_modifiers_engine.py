"""logit_bias, allowed_token_ids and bad_words through the engine: greedy output equals transformers' greedy over
the logits the knobs make (worked out in the test, one logit at a time), at TP=1 and TP=2, on the C sampler and
the torch one; through the OpenAI server with the official client; bad values refused offline and with a 400."""
import httpx
import pytest

from nanovllm_tp import LLM, SamplingParams
from tests.engine.test_lifecycle import N, greedy_with, hf_reference
from tests.unit.test_logits_modifiers import bad_word_spellings, direct
from tests.serving.test_serve import KEY, PROMPTS, client, server  # noqa: F401  (this module's server)
from tests.engine.test_validation import assert_refused, baseline  # noqa: F401  (the refusal check and its baseline)

KINDS = ("logit_bias", "logit_bias + repetition_penalty", "allowed_token_ids", "bad_words")


def found_bad_words(tokenizer, out: list[int]) -> list[str]:
    """Words of the output's text with a spelling of two tokens or more that the output holds (so a ban fires),
    and the text of the output's second token (one token, banned from the start)."""
    def held(s):
        return len(s) > 1 and any(tuple(out[i:i + len(s)]) == s for i in range(len(out)))
    words = [w for w in tokenizer.decode(out).split() if any(held(s) for s in bad_word_spellings(tokenizer, w))]
    single = tokenizer.decode(out[1:2]).strip()
    return words[:1] + ([single] if single else [])


@pytest.fixture(scope="module")
def cases(tiny_llm):
    """(prompt ids, params, kind) per prompt and knob, the knob's values taken from the plain greedy output so that
    each changes it."""
    tok = tiny_llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    plain = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, greedy_with(), use_tqdm=False)]
    out = []
    for prompt, tokens in zip(prompts, plain):
        bias = {tokens[0]: -6.0, tokens[2]: -2.0, 17: 2.5, 33: -250.0}
        out += [(prompt, greedy_with(logit_bias=bias), KINDS[0]),
                (prompt, greedy_with(logit_bias=bias, repetition_penalty=1.6), KINDS[1]),
                (prompt, greedy_with(allowed_token_ids=sorted(set(tokens[1:12]) | {5, 17, 33})), KINDS[2]),
                (prompt, greedy_with(bad_words=found_bad_words(tok, tokens)), KINDS[3])]
    assert sum(len(p.bad_words or ()) == 2 for _, p, _ in out) >= 2, "multi-token bad words found in the outputs"
    return out, plain


@pytest.fixture(scope="module")
def references(cases, hf_model, tiny_llm):
    """transformers' greedy tokens over the logits each case's knobs make."""
    def process(params):
        spellings = [s for w in (params.bad_words or ()) for s in bad_word_spellings(tiny_llm.tokenizer, w)]
        return lambda logits, prompt, out: logits.new_tensor(direct(logits.numpy(), params, prompt, out, spellings))
    return [hf_reference(hf_model, prompt, N, process(params)) for prompt, params, _ in cases[0]]


def generate(llm, cases) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)]


def hot_allowed(llm, prompt) -> list[list[int]]:
    """n = 3 draws at temperature 1.2 from a small allowed set."""
    params = SamplingParams(temperature=1.2, n=3, seed=5, max_tokens=N, ignore_eos=True, allowed_token_ids=[9, 99, 999])
    return [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]


def test_each_knob_greedy_equals_transformers_over_the_knobs_logits(tiny_llm, cases, references):
    got = generate(tiny_llm, cases[0])
    for (_, _, kind), tokens, want in zip(cases[0], got, references):
        assert tokens == want, kind
    plain = [p for p in cases[1] for _ in KINDS]
    assert {kind for (_, _, kind), t, p in zip(cases[0], got, plain) if t != p} == set(KINDS), "each knob acts"
    bias_only, with_penalty = got[0::4], got[1::4]
    assert bias_only != with_penalty                      # the penalty acts on the biased logits
    for tokens, (_, params, kind) in zip(got, cases[0]):
        if kind == "allowed_token_ids":
            assert set(tokens) <= set(params.allowed_token_ids)
    draws = hot_allowed(tiny_llm, cases[0][0][0])
    assert all(set(d) <= {9, 99, 999} for d in draws) and len({tuple(d) for d in draws}) > 1


@pytest.mark.spawn
@pytest.mark.slow
def test_tp2_on_both_samplers_equals_the_references(tiny_model_dir, cases, references, both_paths):
    def run():
        llm = LLM(tiny_model_dir, tensor_parallel_size=2, kvcache_block_size=16, kv_cache_memory=64 << 20)
        try:
            return generate(llm, cases[0]), hot_allowed(llm, cases[0][0][0])
        finally:
            llm.close()
    (fast, fast_hot), (slow, slow_hot) = both_paths(run)
    assert fast == slow == references
    assert all(set(d) <= {9, 99, 999} for d in fast_hot + slow_hot)


@pytest.mark.spawn
def test_server_takes_the_knobs_as_offline_generate_does(server, tiny_llm, cases):  # noqa: F811
    """logit_bias with token ids as string keys (OpenAI's form), allowed_token_ids and bad_words as extra fields,
    on both endpoints, streamed or not: the offline texts."""
    c = client(server)
    offline = tiny_llm.generate([p for p, _, _ in cases[0]], [p for _, p, _ in cases[0]], use_tqdm=False)
    for (prompt, params, kind), want in zip(cases[0], offline):
        extra = {"ignore_eos": True, "repetition_penalty": params.repetition_penalty}
        extra.update({k: getattr(params, k) for k in ("allowed_token_ids", "bad_words") if getattr(params, k)})
        bias = {str(t): b for t, b in (params.logit_bias or {}).items()} or None
        got = c.completions.create(model="tiny", prompt=prompt, max_tokens=N, temperature=0, logit_bias=bias,
                                   extra_body=extra)
        assert got.choices[0].text == want.outputs[0].text, kind
    prompt, params, _ = cases[0][3]
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt=prompt, max_tokens=N, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "bad_words": params.bad_words}))
    assert streamed == offline[3].outputs[0].text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    knobs = dict(logit_bias={17: 3.0, 5: -2.0}, bad_words=["the", "Paris"], allowed_token_ids=list(range(0, 2003, 3)))
    want = tiny_llm.chat(messages, SamplingParams(temperature=0, max_tokens=N, **knobs), use_tqdm=False)[0].outputs[0]
    got = c.chat.completions.create(model="tiny", messages=messages, max_tokens=N, temperature=0,
                                    logit_bias={"17": 3.0, "5": -2.0},
                                    extra_body={k: knobs[k] for k in ("bad_words", "allowed_token_ids")})
    assert got.choices[0].message.content == want.text


@pytest.mark.parametrize("path,body,message", [
    ("completions", {"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": "high"}}, "logit_bias.5"),
    ("completions", {"logit_bias": {"-3": 1.0}}, "token id of logit_bias must be >= 0"),
    ("completions", {"logit_bias": {"99999": 1.0}}, "logit_bias [99999] are outside the vocabulary [0, 2003)"),
    ("completions", {"allowed_token_ids": []}, "allowed_token_ids cannot be empty"),
    ("completions", {"allowed_token_ids": [1, 2003]}, "allowed_token_ids [2003] are outside the vocabulary"),
    ("completions", {"bad_words": "fox"}, "bad_words"),
    ("chat/completions", {"bad_words": ["fox", ""]}, "bad_words cannot contain an empty or blank string"),
    ("chat/completions", {"logit_bias": {"2003": 1.0}}, "logit_bias [2003] are outside the vocabulary"),
])
@pytest.mark.spawn
def test_bad_knob_values_get_a_400_naming_the_field(server, path, body, message):  # noqa: F811
    base = {"model": "tiny", "max_tokens": 2}
    base.update({"prompt": "x"} if path == "completions" else {"messages": [{"role": "user", "content": "x"}]})
    r = httpx.post(f"http://127.0.0.1:{server}/v1/{path}", json={**base, **body}, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "invalid_request_error" and message in error["message"]
    assert client(server).completions.create(model="tiny", prompt="ok", max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize("params,exc,pattern", [
    (dict(logit_bias={2003: 1.0}), ValueError, r"logit_bias \[2003\] are outside the vocabulary \[0, 2003\)"),
    (dict(allowed_token_ids=[5, 2003, 4000]), ValueError, r"allowed_token_ids \[2003, 4000\] are outside"),
    (dict(bad_words=[f"word{i}" for i in range(200)]), ValueError, "at most 128 are allowed"),
])
def test_bad_knob_values_are_refused_before_the_engine_runs(tiny_llm, baseline, params, exc, pattern):  # noqa: F811
    assert_refused(tiny_llm, baseline, exc, pattern, ["Hello, world!", [5, 6, 7]],
                   SamplingParams(temperature=0, max_tokens=4, **params))


def test_knobs_edited_after_construction_are_checked_again(tiny_llm, baseline):  # noqa: F811
    edited = SamplingParams(temperature=0)
    edited.logit_bias = {1: float("nan")}          # fields edited after construction are checked again
    assert_refused(tiny_llm, baseline, ValueError, r"logit_bias\[1\] must be a finite number", "x", edited)
