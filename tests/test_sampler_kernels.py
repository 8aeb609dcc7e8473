"""The sampler's C passes on CPU against their references: logprobs vs torch's log_softmax, the top-k draw vs the
numpy draw of sampler.py (same noise, same masks), the penalties vs float32 numpy arithmetic."""
import shutil

import numpy as np
import pytest
import torch

from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.sampler import _draw_candidates
from nanovllm_tp.scheduler.rows import ROW_DTYPE

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


@pytest.mark.parametrize("cols", [50, 2003, 49152])
def test_draw_top_k_equals_the_numpy_draw(cols):
    rng = np.random.default_rng(cols)
    n = 300
    logits = torch.from_numpy(rng.standard_normal((n, cols)).astype(np.float32) * 3)
    rows = knobs(n, rng)
    rows["top_k"] = np.minimum(rows["top_k"], cols)
    logits[0, :] = float("-inf")                 # a row with 3 tokens left (suppression), k above that
    logits[0, [4, 9, 17]] = torch.tensor([1.0, 2.0, 0.5])
    rows[0]["top_k"], rows[0]["top_p"], rows[0]["min_p"] = min(40, cols), 1.0, 0.0
    counter = rng.integers(0, 5000, n)
    got = cpu_kernels.load().draw_top_k(logits, np.arange(n), rows, counter)
    want = np.empty(n, np.int64)
    for k in np.unique(rows["top_k"]):            # the numpy draw takes one k per call
        sel = np.flatnonzero(rows["top_k"] == k)
        vals, ids = logits[torch.from_numpy(sel)].topk(int(k), dim=-1)
        scaled = vals.numpy() / rows["temperature"][sel][:, None]
        want[sel] = _draw_candidates(scaled, ids.numpy(), rows[sel], counter[sel])
    assert got.tolist() == want.tolist()
    assert got[0] in (4, 9, 17)
    assert len(set(got.tolist())) > min(n, cols) // 4, "the draws vary with seed and knobs"


def test_draw_top_k_reads_the_rows_it_is_given():
    x = torch.full((4, 30), -5.0)
    x[2, 7] = 10.0                                 # row 2's clear winner
    rows = np.zeros(3, ROW_DTYPE)
    rows["temperature"], rows["top_k"], rows["top_p"], rows["seed"] = 1.0, 5, 1.0, [1, 2, 3]
    assert cpu_kernels.load().draw_top_k(x, np.array([2, 2, 2]), rows, np.array([0, 1, 2])).tolist() == [7, 7, 7]


def test_apply_penalties_round_as_float32_numpy():
    rng = np.random.default_rng(3)
    rows = knobs(6, rng)
    x = torch.from_numpy(rng.standard_normal((6, 500)).astype(np.float32) * 5)
    entry = np.repeat(np.arange(6), 40)
    token = np.concatenate([rng.choice(500, 40, replace=False) for _ in range(6)])
    count = rng.integers(0, 4, len(entry)).astype(np.float32)
    want = x.numpy().copy()
    v, rep = want[entry, token], rows["repetition_penalty"][entry]
    v = np.where(v > 0, v / rep, v * rep)
    v -= rows["frequency_penalty"][entry] * count + rows["presence_penalty"][entry] * (count > 0)
    want[entry, token] = v
    cpu_kernels.load().apply_penalties(x, entry, token, count, rows)
    np.testing.assert_array_equal(x.numpy(), want)
