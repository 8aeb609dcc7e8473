"""Logit modifiers (logit_bias, allowed_token_ids, bad_words, with the penalties and min_tokens suppression they
share one list with) on both samplers, the C pass and the numpy/torch code, against a direct computation: each
logit worked out one at a time in vLLM's order (allowed set; bad words, min_tokens, bias; penalties)."""
import numpy as np
import pytest
import torch

from nanovllm_tp.checkpoint.loader import load_tokenizer
from nanovllm_tp.layers.sampler import Sampler
from nanovllm_tp.sampling_params import MAX_BAD_WORDS, SamplingParams
from tests.unit.test_sampler import batch_of, chi_square_ok, draws, softmax

VOCAB = 2003                  # the tiny checkpoint's, so bad words tokenize into it
EOS = 7
NEG = np.float32(-np.inf)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def bad_word_spellings(tokenizer, word: str) -> list[tuple[int, ...]]:
    """vLLM's token sequences of a bad word: the word without its leading spaces, and with one leading space
    when that spelling starts with another token and has as many tokens."""
    plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
    spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
    return [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])


def direct(row: np.ndarray, p: SamplingParams, prompt, output, spellings=()) -> np.ndarray:
    """One entry's logits after its knobs, one logit at a time, in float32 as the samplers round."""
    x = row.astype(np.float32).copy()
    banned = {ids[-1] for ids in spellings
              if len(ids) - 1 <= len(output) and tuple(output[len(output) - len(ids) + 1:]) == ids[:-1]}
    if len(output) < p.min_tokens:
        banned |= set(p.stop_token_ids or ()) | (set() if p.ignore_eos else {EOS})
    seen, bias = set(prompt) | set(output), p.logit_bias or {}
    f32 = np.float32
    for t in range(len(x)):
        if (p.allowed_token_ids is not None and t not in p.allowed_token_ids) or t in banned:
            x[t] = NEG
            continue
        v = x[t]
        if t in bias:
            v = f32(v + f32(min(max(bias[t], -100.0), 100.0)))
        if t in seen:
            v = v / f32(p.repetition_penalty) if v > 0 else v * f32(p.repetition_penalty)
        c = f32(output.count(t))
        x[t] = v - (f32(p.frequency_penalty) * c + f32(p.presence_penalty) * f32(c > 0))
    return x


def assert_same_logits(got: torch.Tensor, want: np.ndarray) -> None:
    got = got.numpy()
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    live = ~np.isneginf(want)
    np.testing.assert_allclose(got[live], want[live], rtol=1e-6, atol=1e-6)


def special_row(rng) -> np.ndarray:
    """Logits with positive, negative, zero, -inf and tied values where the knobs below act."""
    row = rng.standard_normal(VOCAB).astype(np.float32) * 2
    row[[0, 1, 2, 3, 4, 5, 6, 8, 9]] = [2.0, -1.0, 0.0, NEG, 2.0, 0.5, -0.5, 1.0, -3.0]
    row[EOS] = 6.0
    return row


def test_modified_logits_equal_a_direct_computation(both_paths, tokenizer):
    rng = np.random.default_rng(0)
    single, multi = "the", "quick"                   # one token; two tokens, spelled two ways
    spell = bad_word_spellings(tokenizer, single) + bad_word_spellings(tokenizer, multi)
    assert [len(s) for s in spell] == [1, 1, 2, 2]
    cases = [  # (params, prompt, output, logits row)
        (SamplingParams(temperature=0, logit_bias={0: 1.5, 1: 2.5, 2: -0.25, 3: 5.0, 4: 250.0, 9: -250},
                        repetition_penalty=1.7), [1, 2, 0, 11], [12], 0),      # bias, then penalty: -1 -> 1.5 / 1.7
        (SamplingParams(temperature=0, allowed_token_ids=[0, 4, 5, 6, 9, 4], logit_bias={4: -1.0, 8: 10.0},
                        presence_penalty=0.5, frequency_penalty=0.3), [5], [6, 6, 9], 1),
        (SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[5], logit_bias={EOS: 50.0, 2: 1.0},
                        frequency_penalty=-1.1), [3], [2, 2], 0),              # suppression wins over a bias
        (SamplingParams(temperature=0, bad_words=[single, " " + multi], repetition_penalty=0.8),
         [spell[2][0]], [4, spell[3][0]], 1),                                  # " quick"'s first token ends the output
        (SamplingParams(temperature=0, bad_words=[multi]), [spell[2][0]], [], 0),      # a prefix in the prompt: no ban
        (SamplingParams(temperature=0), [1, 2], [3], 1),                               # no knobs: the raw row
    ]
    logits = torch.from_numpy(np.stack([special_row(rng), special_row(rng)]))
    params, prompts, outputs, rows = zip(*cases)
    for p in params:
        p.tokenize_bad_words(tokenizer, VOCAB)
    batch = batch_of(list(params), list(prompts), list(outputs))
    batch.logits_index = np.asarray(rows, np.int64)                       # entries share logits rows, as n > 1 do
    sampler = Sampler(eos_token_ids=[EOS])
    fast, reference = both_paths(lambda: sampler.modified(logits, batch))
    assert torch.equal(fast, reference), "the C pass and the torch path round alike"
    wants = []
    for i, (p, prompt, output, r) in enumerate(cases):
        spellings = [s for w in (p.bad_words or ()) for s in bad_word_spellings(tokenizer, w)]
        wants.append(direct(logits[r].numpy(), p, prompt, output, spellings))
        assert_same_logits(fast[i], wants[-1])
    assert fast[0, 4] == 2.0 + 100.0 and fast[0, 9] == -103.0           # biases clamped to [-100, 100]
    assert (fast[3, [spell[0][0], spell[1][0], spell[3][1]]] == NEG).all()      # "the" twice, " quick"'s last
    assert not np.isneginf(fast[4].numpy()[list(spell[2])]).any()
    (tokens, _), (ref_tokens, _) = both_paths(lambda: sampler(logits, batch))
    assert tokens == ref_tokens == [int(np.argmax(w)) for w in wants]


def test_bias_then_greedy_takes_the_first_of_tied_maxima(both_paths):
    """Integer logits and biases: many exact ties after the bias, where the lowest token id wins."""
    rng = np.random.default_rng(1)
    logits = torch.from_numpy(rng.integers(-4, 5, (64, 500)).astype(np.float32))
    params = [SamplingParams(temperature=0, logit_bias={int(t): float(rng.integers(-3, 4))
                                                        for t in rng.choice(500, 40, replace=False)})
              for _ in range(64)]
    batch = batch_of(params)
    (tokens, _), (ref_tokens, _) = both_paths(lambda: Sampler()(logits, batch))
    want = [int(np.argmax(direct(logits[i].numpy(), p, [0], []))) for i, p in enumerate(params)]
    assert tokens == ref_tokens == want
    assert tokens != logits.argmax(-1).tolist()


LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 1.5, -0.5, 0.2])


@pytest.mark.parametrize("knobs", [{}, {"top_k": 2}, {"top_p": 0.6}, {"min_p": 0.5}])
def test_allowed_tokens_under_temperature_follow_the_allowed_softmax(both_paths, knobs):
    """Draws over many seeds stay in the allowed set and follow softmax((logits + bias) / T) over it, truncated
    by top-k / top-p / min-p as those are defined."""
    p = SamplingParams(temperature=0.8, allowed_token_ids=[1, 3, 4, 6], logit_bias={3: 1.0, 0: 5.0}, **knobs)
    fast, reference = both_paths(lambda: draws(LOGITS, p, 6000))
    assert np.array_equal(fast, reference)
    shifted = direct(LOGITS.numpy(), p, [0], [])
    probs = softmax(torch.from_numpy(shifted) / 0.8)
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros_like(probs, dtype=bool)
    if "top_k" in knobs:
        keep[order[:knobs["top_k"]]] = True
    elif "top_p" in knobs:
        mass = np.cumsum(probs[order]) - probs[order]
        keep[order[mass < knobs["top_p"]]] = True
    else:
        keep = probs >= knobs.get("min_p", 0.0) * probs.max()
    want = np.where(keep, probs, 0)
    assert set(np.flatnonzero(fast)) <= {1, 3, 4, 6}
    assert chi_square_ok(fast, want / want.sum())


def test_bad_word_bans_follow_the_output_as_it_grows(both_paths, tokenizer):
    """A multi-token bad word bans its last token exactly while the output ends with its other tokens: not for a
    prefix in the prompt, nor one split across prompt and output, nor once the output has moved on."""
    word = "beginning"
    spellings = bad_word_spellings(tokenizer, word)
    assert len(spellings) == 1 and len(spellings[0]) == 3           # the spaced spelling has another length
    a, b, c = spellings[0]
    p = SamplingParams(temperature=0, bad_words=[word])
    p.tokenize_bad_words(tokenizer, VOCAB)
    assert p.bad_words_token_ids == ((a, b, c),)
    cases = [([a, b], [], False), ([a], [b], False), ([5], [a, b], True), ([5], [9, a, b], True),
             ([5], [a, b, 9], False), ([5], [a, 9, b], False), ([5], [b], False)]
    logits = torch.zeros(1, VOCAB)
    batch = batch_of([p] * len(cases), [c_[0] for c_ in cases], [c_[1] for c_ in cases])
    batch.logits_index = np.zeros(len(cases), np.int64)
    fast, reference = both_paths(lambda: Sampler().modified(logits, batch))
    assert torch.equal(fast, reference)
    assert [bool(fast[i, c] == NEG) for i in range(len(cases))] == [ban for _, _, ban in cases]
    assert (fast == NEG).sum() == sum(ban for _, _, ban in cases)


def test_bad_words_spellings_and_limits(tokenizer):
    p = SamplingParams(bad_words=["the", "  quick", "fox", "the"])
    p.tokenize_bad_words(tokenizer, VOCAB)
    want = [s for w in ("the", "quick", "fox") for s in bad_word_spellings(tokenizer, w)]
    assert list(p.bad_words_token_ids) == want and len(want) == 5       # "fox"'s spaced spelling is longer
    too_many = SamplingParams(bad_words=[f"w{i}" for i in range(MAX_BAD_WORDS)])
    with pytest.raises(ValueError, match=f"at most {MAX_BAD_WORDS}"):
        too_many.tokenize_bad_words(tokenizer, VOCAB)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        SamplingParams(bad_words=["the"]).tokenize_bad_words(tokenizer, 300)


def test_an_entry_left_without_any_token_takes_column_0(both_paths):
    """allowed_token_ids = [EOS] under min_tokens masks every logit: greedy or drawn, the entry takes the argmax
    of what is left (column 0), on both paths, and its neighbours are untouched."""
    logits = torch.from_numpy(np.random.default_rng(2).standard_normal((8, 50)).astype(np.float32))
    dead = dict(allowed_token_ids=[EOS], min_tokens=3)
    params = [SamplingParams(temperature=0, **dead)] + [
        SamplingParams(temperature=1.0, seed=4, **dead, **knobs)
        for knobs in ({}, {"top_k": 5}, {"top_p": 0.5}, {"min_p": 0.2}, {"top_k": 5, "top_p": 0.5, "min_p": 0.2},
                      {"top_p": 0.5, "min_p": 0.2})] + [SamplingParams(temperature=0, allowed_token_ids=[EOS, 20])]
    batch = batch_of(params)
    (tokens, _), (ref_tokens, _) = both_paths(lambda: Sampler(eos_token_ids=[EOS])(logits, batch))
    assert tokens == ref_tokens == [0] * 7 + [EOS if logits[7, EOS] > logits[7, 20] else 20]


def test_logprobs_stay_the_raw_log_softmax(both_paths):
    """As vLLM's default (raw logprobs): the chosen token's logprob and the top-N come from the model's logits,
    not from the biased or masked ones."""
    logits = torch.from_numpy(np.random.default_rng(3).standard_normal((2, 300)).astype(np.float32))
    params = [SamplingParams(temperature=0, logprobs=3, logit_bias={17: 30.0}),
              SamplingParams(temperature=0.7, seed=1, logprobs=2, allowed_token_ids=[100, 200])]
    (tokens, lp), (ref_tokens, ref_lp) = both_paths(lambda: Sampler()(logits, batch_of(params)))
    assert tokens == ref_tokens and tokens[0] == 17 and tokens[1] in (100, 200)
    raw = torch.log_softmax(logits.double(), -1)
    for i, t in enumerate(tokens):
        assert lp.logprob[i] == pytest.approx(float(raw[i, t]), abs=1e-5)
        assert lp.rank[i] == int((raw[i] > raw[i, t]).sum()) + 1
        assert lp.top_ids[i][:params[i].logprobs].tolist() == raw[i].topk(params[i].logprobs).indices.tolist()
    np.testing.assert_allclose(lp.top_logprobs, ref_lp.top_logprobs, atol=1e-5)


@pytest.mark.parametrize("kw,exc,message", [
    ({"logit_bias": [1, 2]}, TypeError, "logit_bias must be a dict"),
    ({"logit_bias": {"5": 1.0}}, TypeError, "token id of logit_bias must be an int, got str"),
    ({"logit_bias": {-1: 1.0}}, ValueError, "token id of logit_bias must be >= 0"),
    ({"logit_bias": {5: float("nan")}}, ValueError, r"logit_bias\[5\] must be a finite number"),
    ({"logit_bias": {5: float("-inf")}}, ValueError, r"logit_bias\[5\] must be a finite number"),
    ({"logit_bias": {5: "big"}}, TypeError, r"logit_bias\[5\] must be a number, got str"),
    ({"allowed_token_ids": []}, ValueError, "allowed_token_ids cannot be empty"),
    ({"allowed_token_ids": 5}, TypeError, "allowed_token_ids must be a list of ints"),
    ({"allowed_token_ids": [1, -2]}, ValueError, "each of allowed_token_ids must be >= 0"),
    ({"allowed_token_ids": [1, True]}, TypeError, "each of allowed_token_ids must be an int"),
    ({"bad_words": "fox"}, TypeError, "bad_words must be a list of strings"),
    ({"bad_words": ["fox", 3]}, TypeError, "bad_words must be a list of strings"),
    ({"bad_words": ["fox", " "]}, ValueError, "bad_words cannot contain an empty or blank string"),
])
def test_bad_knob_values_are_refused_when_built(kw, exc, message):
    with pytest.raises(exc, match=message):
        SamplingParams(**kw)
