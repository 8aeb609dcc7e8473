"""Sliding-window attention and attention logit soft-capping in the CPU backends (the C decode kernel, the torch
backend's decode and prefill) against attention written out in full here: every row's keys gathered in position
order, scores, the causal and window masks, softmax. Blocks wholly before a row's window are poisoned and their
table entries stale: nothing may read them."""
import shutil

import pytest
import torch

from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.attention.cpu_paged import CpuBackend
from nanovllm_tp.layers.attention.torch_sdpa import TorchBackend
from nanovllm_tp.utils.context import Context
from tests.helpers import random_paged_cache

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
BLOCK, KV_HEADS, GROUP, DIM = 16, 2, 2, 32
SCALE = DIM ** -0.5


def reference(q, k_cache, v_cache, table, rows, window, softcap):
    """rows: (cached, new) per row; q holds each row's new tokens in order. Attention by its definition."""
    out, start = torch.empty_like(q), 0
    for r, (cached, new) in enumerate(rows):
        length = cached + new
        slots = [int(table[r, p // BLOCK]) * BLOCK + p % BLOCK for p in range(length)]
        k = k_cache.flatten(0, 1)[slots].repeat_interleave(GROUP, dim=1)       # [length, heads, dim]
        v = v_cache.flatten(0, 1)[slots].repeat_interleave(GROUP, dim=1)
        qr = q[start:start + new]
        scores = torch.einsum("qhd,khd->hqk", qr, k) * SCALE
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(cached, length)[:, None]
        k_pos = torch.arange(length)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:start + new] = torch.einsum("hqk,khd->qhd", probs, v)
        start += new
    return out


def poison_before_windows(k_cache, v_cache, table, lens, window):
    """Blocks that hold only tokens before every window of their row (the last token's window in decode, the
    first new token's in prefill: `lens` is that token's position + 1): NaN in the cache, and their table
    entries pointed at one poisoned block, as a block freed for the window and reused would be."""
    poisoned = None
    for r, n in enumerate(lens):
        for b in range(max(0, n - window) // BLOCK):
            poisoned = int(table[r, b]) if poisoned is None else poisoned
            k_cache[int(table[r, b])] = float("nan")
            v_cache[int(table[r, b])] = float("nan")
            table[r, b] = poisoned


def decode_case(lens, seed):
    k_cache, v_cache, table = random_paged_cache(lens, BLOCK, KV_HEADS, DIM, seed=seed)
    q = torch.randn(len(lens), KV_HEADS * GROUP, DIM, generator=torch.Generator().manual_seed(seed + 1))
    ctx = Context(is_prefill=False, context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=table,
                  context_lens_cpu=list(lens))
    return q, k_cache, v_cache, table, ctx


@pytest.mark.parametrize("window", [1, 5, 16, 37, 1000])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_decode_sees_only_the_window(backend, window, softcap):
    if backend == "cpu" and cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    lens = [1, 5, 16, 17, 40, 100, 300]
    q, k_cache, v_cache, table, ctx = decode_case(lens, seed=window)
    want = reference(q, k_cache, v_cache, table, [(n - 1, 1) for n in lens], window, softcap)
    full = reference(q, k_cache, v_cache, table, [(n - 1, 1) for n in lens], 0, softcap)
    assert torch.allclose(full[-1], want[-1]) == (window >= 300), "the window changes exactly the long rows"
    poison_before_windows(k_cache, v_cache, table, lens, window)
    impl = CpuBackend() if backend == "cpu" else TorchBackend()
    got = impl.forward(q, None, None, k_cache, v_cache, ctx, SCALE, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@needs_compiler
def test_decode_kernel_soft_cap_changes_the_result_and_bf16_agrees():
    lens = [7, 90]
    q, k_cache, v_cache, table, ctx = decode_case(lens, seed=3)
    q = q * 8        # scores of several units: the cap bites
    capped = CpuBackend().forward(q, None, None, k_cache, v_cache, ctx, SCALE, 0, 1.5)
    torch.testing.assert_close(capped, reference(q, k_cache, v_cache, table, [(n - 1, 1) for n in lens], 0, 1.5),
                               rtol=1e-5, atol=2e-6)
    assert not torch.allclose(capped, CpuBackend().forward(q, None, None, k_cache, v_cache, ctx, SCALE), atol=1e-2)
    half = [t.to(torch.bfloat16) for t in (q, k_cache, v_cache)]
    got = CpuBackend().forward(half[0], None, None, half[1], half[2], ctx, SCALE, 40, 1.5)
    want = reference(*(t.float() for t in half), table, [(n - 1, 1) for n in lens], 40, 1.5)
    torch.testing.assert_close(got.float(), want, rtol=2 ** -6, atol=2 ** -6)


# per row: (cached tokens, new tokens): a whole prompt longer than the window; a chunk over a cached prefix
# longer than the window; a few new tokens (the decode path of the torch backend); a short whole prompt
PREFILL_ROWS = [(0, 70), (45, 30), (100, 3), (0, 9)]
# past the cpu backend's prompt_as_decode (512 tokens in all): SDPA there, whole and over a cached prefix, in the
# same step as rows it takes as decode rows
LONG_ROWS = [(0, 530), (500, 20)]


@pytest.mark.parametrize("window", [1, 8, 20, 200])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_prefill_sees_only_the_window(backend, window, softcap):
    if backend == "cpu" and cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    assert all(c + n <= CpuBackend.prompt_as_decode < c2 + n2 for c, n in PREFILL_ROWS for c2, n2 in LONG_ROWS)
    rows = PREFILL_ROWS + LONG_ROWS
    lens = [c + n for c, n in rows]
    k_cache, v_cache, table = random_paged_cache(lens, BLOCK, KV_HEADS, DIM, seed=window)
    new = [n for _, n in rows]
    q = torch.randn(sum(new), KV_HEADS * GROUP, DIM, generator=torch.Generator().manual_seed(5))
    # this step's K/V are in the cache already (Attention.forward stores them first): read them back
    slots = torch.cat([TorchBackend._slots(table[r:r + 1], BLOCK, lens[r])[0, c:] for r, (c, _) in enumerate(rows)])
    k, v = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
    want = reference(q, k_cache, v_cache, table, rows, window, softcap)
    poison_before_windows(k_cache, v_cache, table, [c + 1 for c, _ in rows], window)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    ctx = Context(is_prefill=True, cu_seqlens_q=cu, max_seqlen_q=max(new), max_seqlen_k=max(lens),
                  context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=table, has_cached_prefix=True,
                  context_lens_cpu=lens, q_lens_cpu=new)
    impl = CpuBackend() if backend == "cpu" else TorchBackend()
    got = impl.forward(q, k, v, k_cache, v_cache, ctx, SCALE, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    # the rows taken as decode rows: the cpu backend's whole short prompts, the torch backend's few new tokens
    assert ctx.as_decode[0] == ([0, 1, 2, 3] if backend == "cpu" else [2])


# ---------------------------------------------------------------- the Triton kernels, through Triton's interpreter

# (window, softcap, decode splits): split-K walks only the window's tiles
TRITON_DECODE = [(5, 0.0, 1), (37, 2.0, 3), (16, 0.0, 3), (0, 2.0, 1)]
TRITON_PREFILL = [(8, 0.0), (20, 2.0), (0, 2.0)]


def _triton_child() -> None:
    """Runs under tests.triton_interpret: the torch-cuda backend's kernels (fp32) against `reference`."""
    import json
    from nanovllm_tp.layers.attention.torch_cuda import CudaTorchBackend
    from nanovllm_tp.layers.triton_decode import paged_decode_attention
    report = []
    lens = [1, 5, 17, 40, 100, 0]
    for window, softcap, splits in TRITON_DECODE:
        q, k_cache, v_cache, table, ctx = decode_case(lens, seed=window)
        want = reference(q[:-1], k_cache, v_cache, table, [(n - 1, 1) for n in lens[:-1]], window, softcap)
        if window:
            poison_before_windows(k_cache, v_cache, table, lens, window)
        got = paged_decode_attention(q, k_cache, v_cache, table, ctx.context_lens, SCALE, splits, window, softcap)
        report.append({"decode": [window, softcap, splits], "max_err": (got[:-1] - want).abs().max().item(),
                       "padding_row_max": got[-1].abs().max().item()})
    for window, softcap in TRITON_PREFILL:
        lens = [c + n for c, n in PREFILL_ROWS]
        k_cache, v_cache, table = random_paged_cache(lens, BLOCK, KV_HEADS, DIM, seed=window)
        new = [n for _, n in PREFILL_ROWS]
        q = torch.randn(sum(new), KV_HEADS * GROUP, DIM, generator=torch.Generator().manual_seed(5))
        want = reference(q, k_cache, v_cache, table, PREFILL_ROWS, window, softcap)
        if window:
            poison_before_windows(k_cache, v_cache, table, [c + 1 for c, _ in PREFILL_ROWS], window)
        cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
        ctx = Context(is_prefill=True, cu_seqlens_q=cu, max_seqlen_q=max(new), max_seqlen_k=max(lens),
                      context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=table,
                      has_cached_prefix=True, context_lens_cpu=lens, q_lens_cpu=new)
        got = CudaTorchBackend().forward(q, None, None, k_cache, v_cache, ctx, SCALE, window, softcap)
        report.append({"prefill": [window, softcap], "max_err": (got - want).abs().max().item()})
    print("RESULT " + json.dumps(report))


@pytest.mark.spawn
@pytest.mark.slow
def test_triton_kernels_see_only_the_window_in_interpreter():
    from tests.unit.test_triton_kernels import run_interpreter_child
    report = run_interpreter_child("_triton_child", "tests.unit.test_window_attention")
    assert len(report) == len(TRITON_DECODE) + len(TRITON_PREFILL)
    for r in report:
        assert r["max_err"] < 1e-4, r            # fp32 on both sides; NaN (a poisoned block read) fails too
        assert r.get("padding_row_max", 0.0) == 0.0, r
