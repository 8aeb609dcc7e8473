"""The sampler against its definitions: softmax(logits / T) draws, top-k / top-p / min-p supports (chi-square),
penalties against a direct computation, min_tokens suppression, logprobs against log_softmax."""
import math

import numpy as np
import pytest
import torch

from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.sampler import Sampler, argmax_rows, uniform_noise, uniform_noise_np
from nanovllm_tp.sampling_params import SamplingParams
from nanovllm_tp.scheduler.rows import SamplingBatch, rows_of
from nanovllm_tp.scheduler.sequence import Sequence


@pytest.fixture(autouse=True, params=["C", "numpy/torch"])
def sampler_path(request, monkeypatch):
    """Every test here runs on both samplers: the C pass the CPU takes and the numpy/torch code of other devices."""
    with cpu_kernels.switched(request.param == "C"):
        yield request.param


def batch_of(params_list, prompts=None, outputs=None, seeds=None, index=None) -> SamplingBatch:
    seqs = []
    for i, p in enumerate(params_list):
        s = Sequence(i, (prompts[i] if prompts else [0]), p, seed=seeds[i] if seeds is not None else i)
        s.token_ids += outputs[i] if outputs else []
        seqs.append(s)
    idx = np.asarray(index if index is not None else [s.num_completion_tokens for s in seqs], np.int64)
    return SamplingBatch(seqs, rows_of(seqs), idx)


def draws(logits: torch.Tensor, params: SamplingParams, n: int) -> np.ndarray:
    """n independent draws (distinct seeds) from one row of logits."""
    batch = batch_of([params] * n, seeds=[i * 7919 + 1 for i in range(n)])
    tokens, _ = Sampler()(logits.repeat(n, 1), batch)
    return np.bincount(tokens, minlength=logits.shape[-1])


def chi_square_ok(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Pearson's test at p = 0.001 over the tokens with non-zero probability; zero-probability tokens never drawn."""
    n = counts.sum()
    support = probs > 0
    if counts[~support].any():
        return False
    expected = probs[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square 0.999 quantile
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3 if dof > 0 else 0.0
    return stat <= limit


LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 1.5, -0.5, 0.2])


def softmax(x: torch.Tensor) -> np.ndarray:
    return torch.softmax(x.double(), -1).numpy()


def test_temperature_draws_follow_softmax():
    counts = draws(LOGITS, SamplingParams(temperature=0.7), 20000)
    assert chi_square_ok(counts, softmax(LOGITS / 0.7))


def test_top_k_draws_follow_the_renormalised_top_k():
    counts = draws(LOGITS, SamplingParams(temperature=1.0, top_k=3), 20000)
    want = softmax(LOGITS)
    want[np.argsort(-want)[3:]] = 0
    assert chi_square_ok(counts, want / want.sum())


def test_top_p_draws_follow_the_smallest_set_over_p():
    probs = softmax(LOGITS)
    order = np.argsort(-probs)
    top_p = float(probs[order[:3]].sum()) - 1e-3      # the top 3 reach it, the top 2 do not
    counts = draws(LOGITS, SamplingParams(temperature=1.0, top_p=top_p), 20000)
    want = np.zeros_like(probs)
    want[order[:3]] = probs[order[:3]]
    assert chi_square_ok(counts, want / want.sum())


def test_min_p_draws_drop_tokens_below_min_p_times_the_top():
    probs = softmax(LOGITS / 0.9)
    counts = draws(LOGITS, SamplingParams(temperature=0.9, min_p=0.3), 20000)
    want = np.where(probs >= 0.3 * probs.max(), probs, 0)
    assert chi_square_ok(counts, want / want.sum())


def test_top_k_one_and_min_p_one_are_greedy_at_any_temperature():
    torch.manual_seed(0)
    logits = torch.randn(64, 300)
    for params in (SamplingParams(temperature=1.7, top_k=1), SamplingParams(temperature=0.5, min_p=1.0)):
        tokens, _ = Sampler()(logits, batch_of([params] * 64))
        assert tokens == logits.argmax(-1).tolist()


def test_mixed_batch_rows_keep_their_own_knobs():
    """A greedy row next to hot rows with other temperatures and seeds draws what it draws alone."""
    torch.manual_seed(1)
    logits = torch.randn(4, 500)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, seed=5),
              SamplingParams(temperature=0.4, top_p=0.8), SamplingParams(temperature=0.9, top_k=7)]
    together, _ = Sampler()(logits, batch_of(params, seeds=[11, 5, 12, 13]))
    for i, p in enumerate(params):
        alone, _ = Sampler()(logits[i:i + 1], batch_of([p], seeds=[[11, 5, 12, 13][i]]))
        assert together[i] == alone[0]
    assert together[0] == int(logits[0].argmax())


def penalized(logits, params, prompts, outputs) -> torch.Tensor:
    """vLLM's penalties, one logit at a time: repetition over prompt and output, frequency and presence over
    the output."""
    want = logits.clone()
    for r, p in enumerate(params):
        seen = set(prompts[r]) | set(outputs[r])
        for t in range(logits.shape[1]):
            x = float(want[r, t])
            if t in seen:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            c = outputs[r].count(t)
            x -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
            want[r, t] = x
    return want


PENALTIES = [SamplingParams(temperature=0, repetition_penalty=1.7),
             SamplingParams(temperature=0, presence_penalty=1.1, frequency_penalty=0.6),
             SamplingParams(temperature=0, repetition_penalty=0.6, presence_penalty=-0.4, frequency_penalty=1.9)]


def test_penalties_match_a_direct_computation():
    torch.manual_seed(2)
    logits = torch.randn(3, 40) * 3
    prompts = [[1, 2, 3, 3], [5, 6], [7]]
    outputs = [[3, 9, 9, 10], [6, 6, 6, 11], [12]]
    batch = batch_of(PENALTIES, prompts, outputs)
    want = penalized(logits, PENALTIES, prompts, outputs)
    got = Sampler().modified(logits, batch)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    tokens, _ = Sampler()(logits, batch)
    assert tokens == want.argmax(-1).tolist()


def test_penalties_follow_sequences_that_grow_between_steps():
    """The counts are kept on each sequence across steps: after each step's new tokens (past the first
    allocation of distinct ids, repeats of prompt tokens among them) they still equal a count from scratch."""
    rng = np.random.default_rng(5)
    vocab = 300
    prompts = [[1, 2, 3, 3], [5, 6], [7]]
    outputs = [[], [], []]
    batch = batch_of(PENALTIES, prompts, outputs)
    for step in range(6):
        for r, seq in enumerate(batch.seqs):
            new = rng.integers(0, vocab if step % 2 else 10, size=int(rng.integers(1, 60))).tolist()
            seq.token_ids += new
            outputs[r] += new
        logits = torch.from_numpy(rng.standard_normal((3, vocab)).astype(np.float32) * 3)
        want = penalized(logits, PENALTIES, prompts, outputs)
        torch.testing.assert_close(Sampler().modified(logits, batch), want, rtol=1e-6, atol=1e-5)


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    logits = torch.zeros(2, 10)
    logits[:, 4] = 50.0                 # EOS would win
    logits[:, 6] = 40.0                 # then the stop id
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[6])
    before = batch_of([p, p], outputs=[[1], [1, 2, 3]])      # 1 and 3 tokens generated so far
    tokens, _ = Sampler(eos_token_ids=(4,))(logits, before)
    assert tokens == [int(logits[0, :4].argmax()), 4]        # row 0 may take neither 4 nor 6
    ignore = SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)
    tokens, _ = Sampler(eos_token_ids=(4,))(logits[:1], batch_of([ignore], outputs=[[1]]))
    assert tokens == [4]                # with ignore_eos, EOS is an ordinary token


def test_logprobs_are_the_raw_log_softmax_with_ranks():
    torch.manual_seed(3)
    logits = torch.randn(3, 100)
    params = [SamplingParams(temperature=0.8, logprobs=5, repetition_penalty=1.5), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logprobs=0)]
    tokens, lp = Sampler()(logits, batch_of(params, outputs=[[3], [], []]))
    raw = torch.log_softmax(logits, -1)
    for i, row in enumerate((0, 2)):
        t = tokens[row]
        assert lp.logprob[i] == pytest.approx(float(raw[row, t]), abs=1e-5)
        assert lp.rank[i] == int((raw[row] > raw[row, t]).sum()) + 1
    top = raw[0].topk(5)
    assert lp.top_ids[0].tolist() == top.indices.tolist()
    np.testing.assert_allclose(lp.top_logprobs[0], top.values.numpy(), atol=1e-5)


def test_noise_is_a_function_of_seed_and_index_only():
    seeds = torch.tensor([1, 2, 1], dtype=torch.int64)
    index = torch.tensor([0, 0, 1], dtype=torch.int64)
    ids = torch.arange(1000)
    u = uniform_noise(seeds, index, ids)
    assert ((u > 0) & (u < 1)).all()
    assert torch.equal(u[0], uniform_noise(seeds[:1], index[:1], ids)[0])
    some = torch.tensor([[7, 3, 999], [5, 0, 1], [2, 2, 640]])      # per-row candidates: the same numbers
    assert torch.equal(uniform_noise(seeds, index, some), u.gather(1, some))
    big = torch.tensor([2**63 - 1, 0, 12345], dtype=torch.int64)                # the host copy: bit for bit
    np.testing.assert_array_equal(uniform_noise_np(big.numpy(), index.numpy(), some.numpy()),
                                  uniform_noise(big, index, some).numpy())
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert abs(u.mean().item() - 0.5) < 0.02


def test_greedy_rows_take_argmax_and_tiny_temperatures_are_greedy():
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=t) for t in (0.0, 1e-7, 1.0, 0.0)]
    tokens, lp = Sampler()(logits, batch_of(params))
    assert [tokens[i] for i in (0, 1, 3)] == logits.argmax(-1)[[0, 1, 3]].tolist() and lp is None


def test_argmax_rows_matches_torch_on_ties_and_slices():
    torch.manual_seed(0)
    x = torch.randn(9, 2010)
    x[0, 5] = x[0, 700] = x[0, 2000] = 100.0       # a three-way tie: the first index wins
    x[1] = 0.0                                      # all equal
    x[2, 3] = float("-inf")
    sliced = x[:, :2003]                            # the LM head's padded-vocab slice: not contiguous
    got = argmax_rows(sliced)
    assert got.dtype == torch.int64
    assert torch.equal(got, sliced.argmax(dim=-1))
    assert got[0].item() == 5 and got[1].item() == 0
