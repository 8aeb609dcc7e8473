"""The sampler's C pass on CPU (csrc/sampler.c) against its references: logprobs vs torch's log_softmax, and whole
steps (penalties, suppression, greedy rows, top-k / top-p / min-p draws, logprobs, shared logits rows) vs the
numpy/torch sampler every other device runs, which draws with the same counter-based noise."""
import shutil

import numpy as np
import pytest
import torch

from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.sampler import Sampler
from nanovllm_tp.sampling_params import SamplingParams
from nanovllm_tp.scheduler.rows import ROW_DTYPE, SamplingBatch, rows_of
from nanovllm_tp.scheduler.sequence import Sequence

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def knobs(n: int, rng: np.random.Generator) -> np.ndarray:
    rows = np.zeros(n, ROW_DTYPE)
    rows["temperature"] = rng.uniform(0.05, 2.0, n)
    rows["top_k"] = rng.integers(1, 120, n)
    rows["min_p"] = rng.choice([0.0, 0.0, 0.02, 0.3], n)
    rows["top_p"] = rng.choice([1.0, 1.0, 0.9, 0.5, 0.05], n)
    rows["seed"] = rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64)
    rows["repetition_penalty"] = rng.choice([1.0, 0.6, 1.7], n)
    rows["frequency_penalty"] = rng.choice([0.0, 0.6, -1.3], n)
    rows["presence_penalty"] = rng.choice([0.0, 1.1, -0.4], n)
    return rows


@pytest.mark.parametrize("rows,cols,top_n", [(3, 40, 0), (9, 2003, 5), (40, 49152, 20)])   # 40 x 49152: threads
def test_row_logprobs_match_log_softmax(rows, cols, top_n):
    g = torch.Generator().manual_seed(cols)
    x = (torch.randn(rows, cols + 5, generator=g) * 4)[:, 5:]        # a row stride that is not the width
    x[1, ::3] = float("-inf")
    row_of = np.array([r for r in range(rows) for _ in range(2)])[::-1].copy()     # rows twice, out of order
    chosen = torch.randint(0, cols, (len(row_of),), generator=g).numpy()
    chosen[0] = int(x[row_of[0]].argmax())
    logprob, rank, top_ids, top_lps = cpu_kernels.load().row_logprobs(x, row_of, chosen, top_n)
    want = torch.log_softmax(x.double(), -1)[torch.from_numpy(row_of)]
    picked = want.gather(1, torch.from_numpy(chosen)[:, None])
    np.testing.assert_allclose(logprob, picked[:, 0].numpy(), rtol=1e-5, atol=2e-5)
    assert rank.tolist() == ((want > picked).sum(1) + 1).tolist()
    assert rank[0] == 1
    best = want.topk(top_n, dim=-1) if top_n else None
    assert top_ids.shape == top_lps.shape == (len(row_of), top_n)
    if top_n:
        assert top_ids.tolist() == best.indices.tolist()
        np.testing.assert_allclose(top_lps, best.values.numpy(), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("k", [1, 5, 50, 300])
@pytest.mark.parametrize("rows,cols", [(1, 300), (7, 2003), (64, 49152)])     # 64 x 49152: the threaded path
def test_top_n_matches_torch_topk(rows, cols, k):
    g = torch.Generator().manual_seed(rows * cols + k)
    x = torch.randn(rows, cols + 3, generator=g)[:, 3:]           # a row stride that is not the width
    x[0, ::7] = float("-inf")                                      # suppressed logits
    x[-1, : cols // 2] = float("-inf")
    k = min(k, cols)
    _, _, ids, _ = cpu_kernels.load().row_logprobs(x, np.arange(rows), np.zeros(rows, np.int64), k)
    want = x.topk(k, dim=-1)
    assert torch.equal(x.gather(1, torch.from_numpy(ids)), want.values)
    assert all(len(set(r)) == k for r in ids.tolist())             # no column twice


def test_top_n_ties_take_the_lower_column_first():
    x = torch.zeros(3, 100)
    x[1, 40:60] = 1.0
    x[2] = float("-inf")                                           # a row of nothing but -inf
    x[2, 99] = 0.0
    _, _, ids, _ = cpu_kernels.load().row_logprobs(x, np.arange(3), np.zeros(3, np.int64), 8)
    assert ids[0].tolist() == list(range(8))
    assert ids[1].tolist() == list(range(40, 48))
    assert ids[2].tolist() == [99, *range(7)]


def random_step(rng: np.random.Generator, entries: int, vocab: int, shared: bool):
    """A step of entries with every knob mixed in, sequences with histories, and (shared) n > 1 siblings reading
    one logits row."""
    seqs = []
    for i in range(entries):
        greedy = rng.random() < 0.25
        params = SamplingParams(
            temperature=0.0 if greedy else float(rng.uniform(0.1, 1.5)),
            top_k=int(rng.choice([0, 0, 1, 5, 50, vocab, vocab + 3])), top_p=float(rng.choice([1.0, 0.95, 0.6, 0.1])),
            min_p=float(rng.choice([0.0, 0.0, 0.05, 0.5])), repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])),
            presence_penalty=float(rng.choice([0.0, 0.7, -0.3])), frequency_penalty=float(rng.choice([0.0, 0.4])),
            min_tokens=int(rng.choice([0, 0, 30])), logprobs=int(rng.choice([0, 3, 20])) if rng.random() < 0.6
            else None, stop_token_ids=[int(rng.integers(0, vocab))] if rng.random() < 0.3 else None,
            ignore_eos=bool(rng.random() < 0.3), max_tokens=100)
        seq = Sequence(i, rng.integers(0, vocab, int(rng.integers(1, 40))).tolist(), params, seed=int(rng.integers(1 << 40)))
        seq.token_ids += rng.integers(0, vocab, int(rng.integers(0, 60))).tolist()
        seqs.append(seq)
    index = np.array([s.num_completion_tokens for s in seqs], np.int64)
    rows = len(seqs) // 2 if shared else len(seqs)
    logits_index = rng.integers(0, rows, len(seqs)) if shared else None
    return SamplingBatch(seqs, rows_of(seqs), index, logits_index), rows


@pytest.mark.parametrize("vocab,shared", [(40, False), (2003, True), (49152, False)])   # 49152: threaded
def test_sampler_step_equals_the_reference_sampler(both_paths, vocab, shared):
    rng = np.random.default_rng(vocab)
    batch, rows = random_step(rng, 120 if vocab < 10000 else 24, vocab, shared)
    logits = torch.from_numpy(rng.standard_normal((rows, vocab)).astype(np.float32) * 4)
    before = logits.clone()
    sampler = Sampler(eos_token_ids=[int(rng.integers(0, vocab))])
    (tokens, lp), (want, want_lp) = both_paths(lambda: sampler(logits, batch))
    assert torch.equal(logits, before), "the logits are read, never written"
    assert tokens == want
    np.testing.assert_allclose(lp.logprob, want_lp.logprob, rtol=1e-5, atol=2e-5)
    assert lp.rank.tolist() == want_lp.rank.tolist()
    assert lp.top_ids.tolist() == want_lp.top_ids.tolist()
    np.testing.assert_allclose(lp.top_logprobs, want_lp.top_logprobs, rtol=1e-5, atol=2e-5)
    hot = batch.rows["temperature"] > 0
    assert len({t for t, h in zip(tokens, hot) if h}) > hot.sum() // 3, "draws vary with seeds and knobs"


def test_suppressed_tokens_are_never_drawn_even_when_nearly_all_are():
    vocab = 64
    eos = list(range(60))             # all but 4 tokens are EOS ids, and every row is still under min_tokens
    logits = torch.zeros(1, vocab)
    logits[0, :60] = 10.0
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p, min_tokens=5, seed=s)
              for k in (0, 10) for p in (1.0, 0.5) for s in range(50)]
    seqs = [Sequence(i, [1, 2], p, seed=p.seed) for i, p in enumerate(params)]
    batch = SamplingBatch(seqs, rows_of(seqs), np.zeros(len(seqs), np.int64), np.zeros(len(seqs), np.int64))
    tokens, _ = Sampler(eos_token_ids=eos)(logits, batch)
    assert set(tokens) <= {60, 61, 62, 63} and len(set(tokens)) > 1
