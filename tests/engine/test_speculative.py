"""Speculative decoding with n-gram proposals: the proposer against a direct search, greedy output equal to
transformers' through chunked prefill, prefix hits, preemption and TP, sampled tokens that follow the target
distribution, and stop strings inside a step of several tokens."""
import random

import numpy as np
import pytest
import torch

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.layers.sampler import Sampler
from nanovllm_tp.sampling_params import RequestOutputKind
from nanovllm_tp.scheduler import Scheduler, SchedulerConfig, Sequence
from nanovllm_tp.scheduler.speculative import SpeculativeConfig, propose_ngram
from tests.helpers import hf_greedy

pytestmark = pytest.mark.kernel_paths     # run again by .ci/run under --packed-linear c+onednn

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SMALL = dict(kvcache_block_size=16, kv_cache_memory=16 << 20)
TEXTS = ["The quick brown fox", "Return a list of", "def main():", "Hello, world! Hello, world! Hello, world!"]


def direct_proposal(tokens: list[int], lo: int, hi: int, k: int, follow: int = -1) -> list[int]:
    """vLLM's rule (the longest n-gram, its earliest occurrence), except that the occurrence followed so far wins
    among those of that n-gram while k tokens follow it."""
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        tail = tokens[-n:]
        starts = [i + n for i in range(len(tokens) - n) if tokens[i:i + n] == tail]   # ends before the last
        if starts:
            start = follow if follow in starts and follow + k <= len(tokens) else starts[0]
            return tokens[start:start + k]
    return []


def test_ngram_proposals_match_a_direct_search():
    rng = random.Random(0)
    for case in range(600):
        tokens = [rng.randrange(1 + case % 6) for _ in range(rng.randint(1, 40))]
        lo = rng.randint(1, 3)
        hi, k = rng.randint(lo, 5), rng.randint(1, 6)
        follow = rng.randrange(-1, len(tokens) + 1) if case % 2 else -1
        got, start = propose_ngram(np.asarray(tokens, np.int64), lo, hi, k, follow)
        assert got.tolist() == direct_proposal(tokens, lo, hi, k, follow), (tokens, lo, hi, k, follow)
        assert got.tolist() == tokens[start:start + len(got)]


def test_ngram_proposer_keeps_reading_the_passage_it_copies():
    """A passage in which "1 2 3 4 5" occurs twice, followed by different tokens each time: a copy that has
    reached its second occurrence through accepted proposals keeps reading there, where vLLM's rule (the earliest
    occurrence of the last n tokens) would jump back to the first."""
    from nanovllm_tp.scheduler.speculative import NgramProposer
    passage = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13]
    proposer = NgramProposer(SpeculativeConfig(2, 3, 2))
    seq = Sequence(0, passage + [0, 6, 7, 1], max_tokens=64)     # the copy has reached "6 7 1": one occurrence
    assert proposer.limits([seq]) == {0: 2}
    assert proposer.propose([seq], [2], []) == [[2, 3]]
    seq.token_ids += [2, 3, 4]                     # both accepted, and the next token: "2 3 4" occurs twice
    proposer.limits([seq])
    assert proposer.propose([seq], [2], []) == [[5, 8]]
    fresh = Sequence(1, list(seq.token_ids), max_tokens=64)       # nothing followed yet: the earliest
    proposer.limits([fresh])
    assert proposer.propose([fresh], [2], []) == [[5, 6]]


def test_speculative_config_is_checked_as_vllm_reads_it(tiny_model_dir):
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 3}) == SpeculativeConfig(3, 5, 5)
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_max": 4}) == SpeculativeConfig(3, 4, 4)
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_min": 2}) == SpeculativeConfig(3, 2, 2)
    for bad, exc, match in [("ngram", TypeError, "speculative_config must be a dict"),
                            ({"method": "ngram"}, ValueError, "needs num_speculative_tokens"),
                            ({"method": "eagle", "num_speculative_tokens": 2}, ValueError, "'eagle' is not implemented"),
                            ({"num_speculative_tokens": 2, "lookup": 3}, ValueError, "unknown key.*'lookup'"),
                            ({"num_speculative_tokens": 0}, ValueError, "num_speculative_tokens must be >= 1"),
                            ({"num_speculative_tokens": 2.0}, TypeError, "num_speculative_tokens must be an int"),
                            ({"num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
                             ValueError, "prompt_lookup_min must be <= 2")]:
        with pytest.raises(exc, match=match):
            LLM(tiny_model_dir, speculative_config=bad)


@pytest.fixture(scope="module")
def spec_llm(tiny_model_dir):
    llm = LLM(tiny_model_dir, speculative_config=NGRAM, max_num_batched_tokens=64, **SMALL)
    yield llm
    llm.close()


@pytest.mark.slow
def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_hits(spec_llm, hf_model):
    tok = spec_llm.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS] + [tok.encode(TEXTS[3]) * 3]      # the last one is chunked (64)
    greedy = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    before = spec_llm.stats()
    for _ in range(2):                                          # the second round hits the prefix cache
        out = spec_llm.generate(prompts, greedy, use_tqdm=False)
        for p, o in zip(prompts, out):
            assert o.outputs[0].token_ids == hf_greedy(hf_model, p, 80)
    stats = spec_llm.stats()
    assert stats["num_accepted_tokens"] - before["num_accepted_tokens"] > 20      # proposals were taken
    assert stats["num_draft_tokens"] > stats["num_accepted_tokens"]               # and some rejected
    assert stats["prefix_cache_hit_tokens"] > before["prefix_cache_hit_tokens"]
    assert stats["kv_cache_usage"] == 0.0


def proposal_steps(llm, prompt: list[int], allowed: list[int], steps: int, per_step: int = 1) -> list[int]:
    """The decode steps (0: the first after the prompt) at which the request got proposals, over `steps` steps
    (each making up to `per_step` tokens). `allowed_token_ids` forces its every token, so whether the n-gram
    proposals are right is known in advance."""
    params = SamplingParams(temperature=0, max_tokens=per_step * steps + 1, ignore_eos=True,
                            allowed_token_ids=allowed)
    llm.add_request(prompt, params)
    llm.step()                                           # the prompt, and the first token
    got, drafts = [], llm.stats()["num_draft_tokens"]
    for step in range(steps):
        llm.step()
        now = llm.stats()["num_draft_tokens"]
        if now > drafts:
            got.append(step)
        drafts = now
    while llm.has_unfinished_requests():
        llm.step()
    return got


def test_proposals_that_keep_failing_back_off_1_3_7_then_15_steps(tiny_model_dir):
    """After each failed proposal a request waits before proposing again: 1, 3, 7 decode steps, then 15 for as
    long as they keep failing; while proposals are taken it proposes every step."""
    spec = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 1, "prompt_lookup_min": 1}
    with LLM(tiny_model_dir, speculative_config=spec, max_model_len=256, **SMALL) as llm:
        # each x is followed by c in the prompt: the proposal after an x is always c, and the request says x
        x, c = 100, 200
        failing = proposal_steps(llm, [x, c] * 8, [x], 60)
        assert failing == [0, 2, 6, 14, 30, 46], failing
        # ... and after a run of x's the proposal is x, always taken: every step proposes
        assert proposal_steps(llm, [x] * 8, [x], 12, per_step=2) == list(range(12))


def assert_greedy_under_preemption(llm, hf, max_tokens: int) -> None:
    """Each of TEXTS twice on a pool too small for all: some preemption, some accepted proposals, every output
    transformers' greedy one, no block held afterwards. Closes llm."""
    try:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(t) for t in TEXTS] * 2
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        out = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["num_accepted_tokens"] > 0, stats
        for p, o in zip(prompts, out):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, max_tokens)
        assert stats["kv_cache_usage"] == 0.0
    finally:
        llm.close()


@pytest.mark.slow
def test_greedy_equals_transformers_under_preemption(tiny_model_dir, hf_model):
    assert_greedy_under_preemption(LLM(tiny_model_dir, speculative_config=NGRAM, kvcache_block_size=16,
                                       kv_cache_memory=700_000, max_model_len=256), hf_model, 120)


@pytest.mark.spawn
@pytest.mark.slow
def test_greedy_equals_transformers_at_tp2(tiny_model_dir, hf_model):
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, speculative_config=NGRAM, **SMALL)
    try:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(t) for t in TEXTS]
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)
        for p, o in zip(prompts, out):
            assert o.outputs[0].token_ids == hf_greedy(hf_model, p, 60)
        assert llm.stats()["num_accepted_tokens"] > 0
    finally:
        llm.close()


def test_requests_with_penalties_or_bad_words_take_no_proposals(spec_llm, hf_model):
    tok = spec_llm.get_tokenizer()
    prompt = tok.encode(TEXTS[3])
    before = spec_llm.stats()["num_draft_tokens"]
    out = spec_llm.generate([prompt] * 2, [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                          repetition_penalty=1.0001),
                                           SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                          bad_words=["zzzz"])], use_tqdm=False)
    assert spec_llm.stats()["num_draft_tokens"] == before
    assert out[1].outputs[0].token_ids == hf_greedy(hf_model, prompt, 40)


def test_logprobs_of_a_speculative_request_are_transformers(spec_llm, hf_model):
    """A request with logprobs takes proposals, and each kept position reports its own logits' log-softmax."""
    tok = spec_llm.get_tokenizer()
    prompt = tok.encode(TEXTS[3])
    before = spec_llm.stats()["num_accepted_tokens"]
    c = spec_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1),
                          use_tqdm=False)[0].outputs[0]
    assert spec_llm.stats()["num_accepted_tokens"] > before
    assert c.token_ids == hf_greedy(hf_model, prompt, 40) and len(c.logprobs) == 40
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1], -1)
    got = [position[token].logprob for token, position in zip(c.token_ids, c.logprobs)]
    assert np.allclose(got, ref[torch.arange(40), c.token_ids].tolist(), atol=1e-3)


def test_sampled_tokens_follow_the_target_distribution():
    """Fixed logits, the real scheduler and sampler: the prompt makes the n-gram propose [d1, d2]; over many seeds
    the token at the first proposed position follows softmax(L0) and, where d1 was accepted, the next follows
    softmax(L1) (chi-square, p = 0.001)."""
    vocab, d1, d2, n = 8, 3, 6, 3000
    rng = np.random.default_rng(0)
    fixed = rng.normal(0, 1, (3, vocab)).astype(np.float32)
    fixed[0, d1] += 1.0                                     # d1 likely, not certain
    spec = SpeculativeConfig(2, 2, 1)
    sched = Scheduler(SchedulerConfig(num_kvcache_blocks=n * 2 + 8, kvcache_block_size=16, max_model_len=64,
                                      max_num_seqs=n, max_num_batched_tokens=n * 8, speculative=spec))
    for s in range(n):
        sched.add(Sequence(s, [5, d1, d2, 7, 5], SamplingParams(temperature=1.0, max_tokens=8), seed=s))
    sampler = Sampler()
    step = sched.schedule()                                 # the prefill: every row's first token is 5
    logits = torch.full((n, vocab), -1e9)
    logits[:, 5] = 0
    tokens, _ = sampler(logits, step.sampling)
    sched.postprocess(tokens)
    step = sched.schedule()
    assert step.plan.num_tokens == 3 * n and all(s.draft == [d1, d2] for s in step.sampling.seqs[::3])
    rows = torch.from_numpy(np.tile(fixed, (n, 1)))
    tokens, _ = sampler(rows, step.sampling)
    progressed = sched.postprocess(tokens)
    first = np.array([s.token_ids[6] for s in progressed])
    second = np.array([s.token_ids[7] for s in progressed if s.token_ids[6] == d1])
    assert len(second) > n // 10
    assert sched.num_accepted_tokens == len(second) + int((np.array([s.token_ids[7] for s in progressed
                                                                     if s.token_ids[6] == d1]) == d2).sum())
    for got, row in ((first, fixed[0]), (second, fixed[1])):
        p = np.exp(row - row.max())
        p /= p.sum()
        counts = np.bincount(got, minlength=vocab)
        chi2 = (((counts - len(got) * p) ** 2) / (len(got) * p)).sum()
        assert chi2 < 24.32, (chi2, counts, len(got) * p)       # 7 degrees of freedom, p = 0.001


def test_a_stop_string_inside_a_step_of_several_tokens(spec_llm, hf_model):
    """The stop string ends the output at the token that completes it, however many tokens the step added:
    text, token ids and streamed deltas all stop there."""
    tok = spec_llm.get_tokenizer()
    prompt = tok.encode(TEXTS[3])
    ref = hf_greedy(hf_model, prompt, 80)
    stop_at = 60                                            # deep in a repeating stretch: several tokens a step
    stop = tok.decode(ref[stop_at - 2:stop_at])
    text = tok.decode(ref)
    cut = text.index(stop)
    want_ids = next(ref[:i] for i in range(1, 81) if stop in tok.decode(ref[:i]))
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA):
        params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, stop=[stop], output_kind=kind)
        rid = spec_llm.add_request(prompt, params)
        deltas, final = [], None
        while spec_llm.has_unfinished_requests():
            for o in spec_llm.step():
                if o.request_id == rid:
                    deltas.append(o.outputs[0].text)
                    final = o if o.finished else final
        c = final.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        if kind == RequestOutputKind.DELTA:
            assert "".join(deltas) == text[:cut]
        else:
            assert c.text == text[:cut] and c.token_ids == want_ids


def test_a_stop_string_on_the_last_allowed_token_stops(tiny_llm, hf_model):
    """The token that max_tokens allows last completes a stop string: the reason is "stop" and the text is cut
    (it used to say "length" and keep the stop)."""
    tok = tiny_llm.get_tokenizer()
    for text_prompt in TEXTS:                 # a case where the last token's text occurs first at the end
        prompt = tok.encode(text_prompt)
        ref = hf_greedy(hf_model, prompt, 12)
        text, stop = tok.decode(ref), tok.decode(ref[11:]).strip()
        if stop and text.find(stop) == len(text.rstrip()) - len(stop) and text.endswith(stop):
            break
    else:
        raise AssertionError("no prompt of TEXTS ends its first 12 greedy tokens with a fresh string")
    out = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == text[:len(text) - len(stop)] and out.token_ids == ref


@pytest.mark.spawn
@pytest.mark.slow
def test_the_server_streams_speculative_output(tiny_model_dir, hf_model):
    """Through the `openai` client: streamed chunks of a server with n-gram speculation concatenate to
    transformers' greedy text, also with a stop string met inside a step."""
    import json as _json

    from tests.serving.test_serve import client, metrics, start_server, wait_ready
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = TEXTS[3]
    ref = hf_greedy(hf_model, tok.encode(prompt), 60)
    text = tok.decode(ref)
    stop = tok.decode(ref[50:52])
    port, ctx = start_server(tiny_model_dir, "--api-key", "k", "--speculative-config", _json.dumps(NGRAM))
    with ctx as proc:
        wait_ready(port, proc)
        api = client(port, "k")
        for stops, want in ((None, text), ([stop], text[:text.index(stop)])):
            chunks = api.completions.create(model="tiny", prompt=prompt, max_tokens=60, temperature=0, stream=True,
                                            stop=stops, extra_body={"ignore_eos": True})
            got = "".join(c.choices[0].text for c in chunks)
            assert got == want
        m = metrics(port)
        accepted = m["spec_decode_num_accepted_tokens_total{model_name=\"tiny\"}"]
        assert 0 < accepted <= m["spec_decode_num_draft_tokens_total{model_name=\"tiny\"}"]
        per_pos = [m[f"spec_decode_num_accepted_tokens_per_pos_total{{model_name=\"tiny\",position=\"{j}\"}}"]
                   for j in range(NGRAM["num_speculative_tokens"])]
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seeded_sampling_under_batch_invariant_is_plain_decoding_token_for_token(tiny_model_dir, dtype):
    """docs/features.md's guarantee: under batch_invariant a cold prompt alone gets the same tokens and logprobs
    with n-gram speculation as without (seeded sampling), for a prompt of at most 64 tokens (a row-count bucket
    that the speculating engine's default would run through the C kernel and the plain engine's through the
    timed table's winner) and for a longer one; proposals were taken along the way."""
    rng = random.Random(3)
    head = [rng.randrange(100, 1000) for _ in range(20)]
    prompts = [head * 3, head * 5 + [rng.randrange(100, 1000) for _ in range(30)]]          # 60 and 130 tokens
    params = SamplingParams(temperature=0.8, seed=1234, max_tokens=64, ignore_eos=True, logprobs=1)
    # packed_linear="auto": batch_invariant settles its own linear kernel, whatever default --packed-linear sets
    knobs = dict(batch_invariant=True, packed_linear="auto", dtype=dtype, **SMALL)
    outs = {}
    for name, extra in (("plain", {}), ("ngram", {"speculative_config": NGRAM})):
        with LLM(tiny_model_dir, **knobs, **extra) as llm:
            outs[name] = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
            stats = llm.stats()
    assert stats["num_draft_tokens"] >= 20 and stats["num_accepted_tokens"] >= 4, stats   # verify steps ran
    for plain, spec in zip(outs["plain"], outs["ngram"], strict=True):
        assert spec.token_ids == plain.token_ids
        assert [{t: lp.logprob for t, lp in s.items()} for s in spec.logprobs] == \
            [{t: lp.logprob for t, lp in s.items()} for s in plain.logprobs]
