"""The Triton kernels of the torch-cuda backend, checked without a GPU: paged decode (split-K too) and paged
prefill over cached prefixes against the torch reference backend through Triton's CPU interpreter (in a child
process, so TRITON_INTERPRET never leaks into this one), and compiled for an H200 (sm_90a) with Triton's bundled
ptxas to check that no tile spills registers. tests/gpu runs the same kernels on a device.
"""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from nanovllm_tp.layers.attention.torch_sdpa import TorchBackend
from nanovllm_tp.utils.context import Context
from nanovllm_tp.workers.cuda_graph import DecodeInputs
from tests.helpers import random_paged_cache, random_paged_decode
from tests.unit.test_gpu_path_cpu import make_decode_plan

REPO = pathlib.Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- Triton decode kernel via the interpreter

DECODE_CONFIGS = [(g, bs, 32, 1) for g in (1, 2, 4) for bs in (8, 16, 32)] + [(2, 16, 128, 1), (3, 8, 32, 1)] + [
    (2, 16, 32, 3), (4, 8, 32, 8), (1, 256, 64, 2), (3, 16, 80, 3), (2, 128, 32, 16)]     # split-K (flash-decoding)


def _interpreter_child() -> None:
    """Runs in a fresh interpreter after tests.triton_interpret: the kernel vs TorchBackend's decode."""
    from nanovllm_tp.layers import triton_decode
    assert type(triton_decode._paged_decode_kernel).__name__ == "InterpretedFunction"
    reference, report = TorchBackend(), []
    for group, block_size, head_dim, splits in DECODE_CONFIGS:
        # 1 token, exact block multiples, ragged, one short of a block, and a zero-length padding row
        lens = [1, block_size, 2 * block_size, 3 * block_size + 5, block_size - 1, 0]
        q, k_cache, v_cache, table, context_lens = random_paged_decode(lens, block_size, 2, group, head_dim,
                                                                       seed=len(report))
        scale = head_dim ** -0.5
        out = triton_decode.paged_decode_attention(q, k_cache, v_cache, table, context_lens, scale, splits)
        live = [i for i, n in enumerate(lens) if n]
        ctx = Context(is_prefill=False, context_lens=context_lens[live], block_tables=table[live],
                      context_lens_cpu=[lens[i] for i in live])
        want = reference.forward(q[live], None, None, k_cache, v_cache, ctx, scale)
        report.append({"group": group, "block_size": block_size, "head_dim": head_dim, "splits": splits,
                       "max_err": (out[live] - want).abs().max().item(),
                       "padding_row_max": out[lens.index(0)].abs().max().item(),
                       "finite": bool(torch.isfinite(out).all())})
    print("RESULT " + json.dumps(report))


def test_decode_split_and_tile_choice():
    from nanovllm_tp.layers.triton_decode import MAX_SPLITS, decode_splits, decode_tile
    # the fp32 [group, tile, head_dim] product stays at 8K elements: no spills at any page size
    assert [decode_tile(g, 128) for g in (1, 2, 4, 8, 16)] == [64, 32, 16, 8, 8]
    assert decode_tile(1, 64) == 64 and decode_tile(2, 256) == 16
    # H200: 132 SMs. A full batch already fills the GPU: no split
    assert decode_splits(256, 8, 1280, 132) == 1
    # one long row (40,960 tokens, tile 32): as many splits as allowed
    assert decode_splits(1, 8, 1280, 132) == MAX_SPLITS
    assert decode_splits(4, 8, 1280, 132) == 9         # 4 * 8 * 9 = 288 programs >= 2 * 132
    # short block tables: every split keeps at least 4 tiles
    assert decode_splits(1, 8, 12, 132) == 3 and decode_splits(1, 8, 3, 132) == 1


def run_interpreter_child(function: str, module: str = "tests.unit.test_triton_kernels") -> list[dict]:
    """Run one of `module`'s *_child functions (this module's by default) in a fresh interpreter under Triton's
    CPU interpreter."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)
    code = f"import tests.triton_interpret\nimport {module} as t\nt.{function}()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, f"interpreter child failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(line[len("RESULT "):])


@pytest.mark.spawn
@pytest.mark.slow
def test_triton_decode_kernel_matches_torch_backend_in_interpreter():
    report = run_interpreter_child("_interpreter_child")
    assert len(report) == len(DECODE_CONFIGS)
    for r in report:
        assert r["finite"], r
        assert r["max_err"] < 1e-4, r          # fp32 on both sides: only summation order differs
        assert r["padding_row_max"] == 0.0, r  # a zero-length row (graph padding) gives exact zeros


# ---------------------------------------------------------------- Triton paged prefill (cached prefixes) via the interpreter

# (group, block_size, head_dim, dtype): fp32 exact up to summation order; fp16 takes the half-precision tl.dot
# path (bf16 is the same code on a GPU, but the interpreter's tl.dot multiplies bf16's raw bits)
PREFILL_CONFIGS = [(1, 16, 32, "float32"), (2, 16, 64, "float32"), (4, 8, 32, "float32"), (3, 32, 80, "float32"),
                   (2, 256, 32, "float32"), (2, 16, 64, "float16")]
# per row: (cached tokens, new tokens): no prefix; a prefix ending mid-block; one new token over a long prefix
# (a decode row of a mixed step); more new tokens than one query tile over a prefix; a long prefix
PREFILL_ROWS = [(0, 20), (37, 11), (150, 1), (21, 70), (300, 5)]


def _prefill_interpreter_child() -> None:
    from nanovllm_tp.layers import triton_prefill
    from nanovllm_tp.layers.attention.torch_cuda import CudaTorchBackend
    assert type(triton_prefill._paged_prefill_kernel).__name__ == "InterpretedFunction"
    reference, backend, report = TorchBackend(), CudaTorchBackend(), []
    for group, block_size, head_dim, dtype_name in PREFILL_CONFIGS:
        dtype = getattr(torch, dtype_name)
        cached, new = [c for c, _ in PREFILL_ROWS], [n for _, n in PREFILL_ROWS]
        lens = [c + n for c, n in PREFILL_ROWS]
        k_cache, v_cache, table = random_paged_cache(lens, block_size, 2, head_dim, dtype, seed=len(report))
        q = torch.randn(sum(new), 2 * group, head_dim, generator=torch.Generator().manual_seed(7)).to(dtype)
        # this step's K/V are already in the cache (Attention.forward stores them first): read them back
        slots = torch.cat([TorchBackend._slots(table[r:r + 1], block_size, lens[r])[0, cached[r]:]
                           for r in range(len(lens))])
        k = k_cache.flatten(0, 1)[slots]
        v = v_cache.flatten(0, 1)[slots]
        cu = torch.tensor(np.concatenate(([0], np.cumsum(new))), dtype=torch.int32)
        ctx = Context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=None, max_seqlen_q=max(new),
                      max_seqlen_k=max(lens), context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=table,
                      has_cached_prefix=True, context_lens_cpu=lens, q_lens_cpu=new)
        scale = head_dim ** -0.5
        got = backend.forward(q, k, v, k_cache, v_cache, ctx, scale)     # routes to the paged Triton kernel
        want = reference.forward(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), ctx, scale)
        report.append({"config": [group, block_size, head_dim, dtype_name],
                       "max_err": (got.float() - want).abs().max().item(), "finite": bool(torch.isfinite(got).all())})
    report.append(_stale_columns_decode_check())
    print("RESULT " + json.dumps(report))


def _stale_columns_decode_check() -> dict:
    """Decode through DecodeInputs after a wider plan: the columns it did not copy are never read."""
    from nanovllm_tp.layers.triton_decode import paged_decode_attention
    bs, null_slot = 8, 0
    wide_lens, lens = [40, 70, 9], [3, 12, 9]
    k_cache, v_cache, table = random_paged_cache(wide_lens, bs, 2, 32, seed=5)
    inputs = DecodeInputs(max_rows=4, width=16, device=torch.device("cpu"))
    to_lists = lambda t, n: [[b for b in r if b >= 0][:-(-x // bs)] for r, x in zip(t.tolist(), n)]  # noqa: E731
    inputs.fill(make_decode_plan(wide_lens, to_lists(table, wide_lens), bs), rows=4, null_slot=null_slot)
    inputs.fill(make_decode_plan(lens, to_lists(table, lens), bs), rows=4, null_slot=null_slot)
    ctx = inputs.context(4)
    q = torch.randn(4, 4, 32, generator=torch.Generator().manual_seed(9))
    got = paged_decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, 32 ** -0.5, 2)
    ref_ctx = Context(is_prefill=False, context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=table,
                      context_lens_cpu=lens)
    want = TorchBackend().forward(q[:3], None, None, k_cache, v_cache, ref_ctx, 32 ** -0.5)
    return {"config": "decode after a wider plan", "max_err": (got[:3] - want).abs().max().item(),
            "finite": bool(torch.isfinite(got).all()), "padding_row_max": got[3].abs().max().item(),
            "stale_columns": int((ctx.block_tables[:3, 2:] >= 0).sum())}


@pytest.mark.spawn
@pytest.mark.slow
def test_triton_prefill_kernel_matches_torch_backend_in_interpreter():
    report = run_interpreter_child("_prefill_interpreter_child")
    assert len(report) == len(PREFILL_CONFIGS) + 1
    for r in report[:-1]:
        assert r["finite"], r
        assert r["max_err"] < (1e-2 if "float16" in r["config"] else 1e-4), r
    stale = report[-1]
    assert stale["stale_columns"] > 0, "the check needs columns left over from the wider plan"
    assert stale["finite"] and stale["max_err"] < 1e-4 and stale["padding_row_max"] == 0.0, stale


# ---------------------------------------------------------------- the Triton kernels compile for an H200 (sm_90a)

def _ptxas_report(fn, dtype: str, constexprs: dict, num_warps: int) -> tuple[int, int]:
    """Compile a kernel for sm_90a without a GPU (Triton's bundled ptxas): (registers, spill store bytes)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    pointers = {"q_ptr": dtype, "k_cache_ptr": dtype, "v_cache_ptr": dtype, "out_ptr": dtype, "part_ptr": "fp32",
                "stats_ptr": "fp32", "block_tables_ptr": "i32", "context_lens_ptr": "i32", "cu_seqlens_q_ptr": "i32"}
    names = list(fn.arg_names)
    signature = {n: "constexpr" if n in constexprs else "*" + pointers[n] if n in pointers else
                 "fp32" if n in ("scale", "softcap") else "i32" for n in names}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature,
                                      constexprs={(names.index(k),): v for k, v in constexprs.items()}),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    import tempfile
    ptx = pathlib.Path(tempfile.gettempdir()) / f"nvtp_{os.getpid()}_{fn.__name__}.ptx"
    ptx.write_text(kernel.asm["ptx"])
    try:
        ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        text = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", os.devnull],
                              capture_output=True, text=True, timeout=120).stderr
    finally:
        ptx.unlink()
    return int(re.search(r"Used (\d+) registers", text).group(1)), \
        int(re.search(r"(\d+) bytes spill stores", text).group(1))


@pytest.mark.slow
def test_triton_kernels_compile_for_sm90_without_register_spills():
    """The tile no longer grows with the page size: block 16, 128 and 256 compile to the same kernel shape
    with no spills (the old [group, block, head_dim] tile spilled ~18 KB per thread at block 128)."""
    import triton
    from nanovllm_tp.layers import triton_decode as td
    from nanovllm_tp.layers import triton_prefill as tp
    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton build has no bundled ptxas")
    for block_size, softcap in ((16, False), (128, False), (256, True)):     # softcap: Gemma 2's variant
        regs, spill = _ptxas_report(td._paged_decode_kernel, "bf16", dict(
            GROUP=2, GROUP_PAD=2, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=block_size, TILE=td.decode_tile(2, 128),
            SPLIT=True, SOFTCAP=softcap), 4)
        assert spill == 0 and regs <= 255, (block_size, regs, spill)
    assert _ptxas_report(td._merge_splits_kernel, "bf16", dict(HEAD_DIM=128, HEAD_DIM_PAD=128,
                                                                 SPLITS_PAD=td.MAX_SPLITS), 4)[1] == 0
    for dtype, precision, softcap in (("bf16", "tf32", False), ("fp32", "ieee", False), ("bf16", "tf32", True)):
        regs, spill = _ptxas_report(tp._paged_prefill_kernel, dtype, dict(
            GROUP=2, GROUP_PAD=2, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16, BLOCK_M=tp.prefill_block_m(2),
            BLOCK_N=tp.BLOCK_N, PRECISION=precision, SOFTCAP=softcap), tp.NUM_WARPS)
        assert spill == 0, (dtype, softcap, regs, spill)
