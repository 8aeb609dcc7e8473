"""The quantized KV cache's pieces: the store against the format written out in tests/kv_reference.py (and the C
store against the torch one at every rounding case), the C decode kernel and the torch backend's dequantizing reads
against attention over the dequantized values, the dense copies the CUDA backends get, the budget arithmetic and the
refusals."""
import shutil

import pytest
import torch

from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.attention import AttentionBackend
from nanovllm_tp.layers.attention.base import BACKENDS, register_backend
from nanovllm_tp.layers.attention.cpu_paged import CpuBackend
from nanovllm_tp.layers.attention.kv_quant import KV_CACHE_DTYPES, dequantize, quantize, store_quantized
from nanovllm_tp.layers.attention.registry import select_backend
from nanovllm_tp.layers.attention.torch_sdpa import TorchBackend
from nanovllm_tp.utils.context import Context
from nanovllm_tp.workers.kv_cache import allocate_kv_cache, kv_block_bytes
from tests.helpers import random_paged_cache
from tests.kv_reference import FORMATS, query_as_read, roundtrip

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
QUANTIZED = ["int8", "fp8_e4m3", "fp8_e5m2"]


def quantized_cache(lens, block_size, kv_heads, head_dim, kv_cache_dtype, seed=0, x_dtype=torch.float32):
    """A random paged cache stored through store_quantized: (k, v, (k_scale, v_scale), table, the K/V stored,
    and what the store read back), every slot written (the spare blocks too)."""
    k, v, table = random_paged_cache(lens, block_size, kv_heads, head_dim, dtype=x_dtype, seed=seed)
    k[0, 0] = 0.0       # a zero vector: scale 0, values 0
    qk, qv, scales = allocate_kv_cache(1, k.shape[0], block_size, kv_heads, head_dim, x_dtype, "cpu",
                                       kv_cache_dtype)
    qk, qv, scales = qk[0], qv[0], (scales[0][0], scales[1][0])
    slots = torch.arange(k.shape[0] * block_size)
    back = store_quantized(k.flatten(0, 1), v.flatten(0, 1), qk, qv, scales, slots, readback=True)
    return qk, qv, scales, table, k, v, back


def dequantized(cache, scale):
    return cache.float() * scale.unsqueeze(-1)


@pytest.mark.parametrize("kernels", [True, False], ids=["c", "torch"])      # int8 has a C store on CPU
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv", QUANTIZED)
def test_store_holds_the_format_and_reads_back_the_roundtrip(kv, x_dtype, kernels):
    with cpu_kernels.switched(kernels):
        qk, qv, (ks, vs), _, k, v, (back_k, back_v) = quantized_cache([40, 9], 16, 2, 32, kv, x_dtype=x_dtype)
    assert back_k.dtype is x_dtype
    dtype, qmax = FORMATS[kv]
    assert qk.dtype is dtype and ks.dtype is torch.float32 and ks.shape == qk.shape[:3]
    torch.testing.assert_close(ks, k.float().abs().amax(-1) / qmax, rtol=0, atol=0)
    assert not ks[0, 0].any() and not qk[0, 0].float().any()
    # the largest element of every other vector lands on the format's largest value
    assert torch.equal(qk.float().abs().amax(-1)[ks > 0], torch.full_like(ks[ks > 0], qmax))
    for cache, scale, x, back in ((qk, ks, k, back_k), (qv, vs, v, back_v)):
        want = roundtrip(x, kv)
        assert torch.equal(dequantized(cache, scale).to(x_dtype), want)
        assert torch.equal(back.view_as(x), want)
    if kv == "int8":   # rounded to nearest: within half a step
        assert ((dequantized(qk, ks) - k.float()).abs() <= ks.unsqueeze(-1) * 0.5001).all()


def rounding_cases(kv: str) -> torch.Tensor:
    """fp32 values in [-QMAX, QMAX] at every rounding decision of the format: each representable value, each
    midpoint between neighbours (a tie) and the floats just either side of both."""
    dtype, qmax = FORMATS[kv]
    if dtype is torch.int8:
        grid = torch.arange(-127, 128, dtype=torch.float64)
    else:
        grid = torch.arange(256, dtype=torch.uint8).view(dtype).double()
        grid = grid[grid.isfinite()].unique()
    points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2]).float()      # midpoints are exact in fp32
    near = torch.cat([points, torch.nextafter(points, torch.tensor(-1e9)), torch.nextafter(points, torch.tensor(1e9))])
    return near[near.abs() <= qmax]


@needs_compiler
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv", QUANTIZED)
def test_c_store_rounds_every_case_as_torch_casts(kv, x_dtype):
    """csrc/kv_store.c against kv_quant.quantize, the torch form, to the bit: vectors whose largest value is QMAX
    (scale 1: each other value is rounded as it is) holding every rounding case, ties included, and vectors of
    random scales; codes, scales and the read-back values."""
    dtype, qmax = FORMATS[kv]
    cases = rounding_cases(kv)
    dim = 32
    cases = torch.cat([cases, cases.new_zeros(-len(cases) % (dim - 1))]).view(-1, dim - 1)
    exact = torch.cat([torch.full((cases.shape[0], 1), qmax), cases], 1)
    gen = torch.Generator().manual_seed(5)
    scaled = torch.randn(64, dim, generator=gen) * torch.logspace(-30, 30, 64)[:, None]
    x = torch.cat([exact, scaled, torch.zeros(1, dim), torch.full((1, dim), -0.0)]).to(x_dtype).view(-1, 1, dim)
    values, scale = quantize(x, dtype)
    cache = torch.zeros(x.shape[0], 1, dim, dtype=dtype)
    scales = torch.zeros(x.shape[0], 1)
    back = cpu_kernels.load().kv_store(x, torch.arange(x.shape[0]), cache, scales, readback=True)
    assert torch.equal(cache.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(scales, scale) and torch.equal(back, dequantize(values, scale, x_dtype))


@needs_compiler
@pytest.mark.parametrize("kv", QUANTIZED)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group,window,softcap", [(64, 3, 0, 0.0), (48, 2, 20, 0.0), (32, 1, 0, 5.0)])
def test_decode_kernel_matches_attention_over_dequantized_values(kv, q_dtype, head_dim, group, window, softcap):
    lens = [1, 16, 37, 70, 5, 300]
    qk, qv, scales, table, *_ = quantized_cache(lens, 16, 2, head_dim, kv, seed=head_dim + group)
    q = torch.randn(len(lens), 2 * group, head_dim, generator=torch.Generator().manual_seed(7)).to(q_dtype)
    ctx = Context(is_prefill=False, context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=table,
                  context_lens_cpu=lens)
    assert cpu_kernels.load() is not None
    with cpu_kernels.switched(True):
        got = CpuBackend().forward(q, None, None, qk, qv, ctx, head_dim ** -0.5, window, softcap, scales)
    # the direct computation: fp32 queries (as the kernel reads them) over fp32 dequantized K/V through the torch
    # backend's dense decode
    want = TorchBackend().forward(query_as_read(q, kv).float(), None, None, dequantized(qk, scales[0]),
                                  dequantized(qv, scales[1]), ctx, head_dim ** -0.5, window, softcap)
    assert got.dtype is q_dtype
    # fp32: only the order differs (the kernel applies K's scale to the dot product); bf16: the output's rounding
    tolerance = dict(rtol=1e-5, atol=3e-6) if q_dtype is torch.float32 else dict(rtol=2 ** -7, atol=2 ** -8)
    torch.testing.assert_close(got.float(), want, **tolerance)


@needs_compiler
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_decode_kernel_widens_every_fp8_code_as_torch_does(kv):
    """Rows of one token: the output is that token's V times its scale, so every finite code shows (a scaled
    store writes no NaN or inf)."""
    dtype = FORMATS[kv][0]
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).float()
    codes = codes[values.isfinite()]
    rows = codes.numel() // 8                   # head_dim 8: one vector of codes per row, each in its own block
    v = codes[:rows * 8].view(rows, 1, 1, 8).view(dtype).contiguous()
    k = torch.zeros_like(v)
    scale = torch.full((rows, 1, 1), 0.5)
    q = torch.randn(rows, 1, 8)
    table = torch.arange(rows, dtype=torch.int32)[:, None]
    out = cpu_kernels.load().paged_decode(q, k, v, table, torch.ones(rows, dtype=torch.int32), 1.0,
                                          kv_scales=(scale, scale))
    assert torch.equal(out[:, 0], v[:, 0, 0].float() * 0.5)


@pytest.mark.parametrize("kv", QUANTIZED)
def test_torch_backend_dequantizes_what_it_gathers(kv):
    """Prefill over a cached prefix and decode, each against the same backend on the dequantized cache."""
    lens = [40, 70, 17]
    qk, qv, scales, table, *_ = quantized_cache(lens, 16, 2, 32, kv, seed=3)
    dense = dequantized(qk, scales[0]), dequantized(qv, scales[1])
    q_lens = [5, 40, 1]          # a row of a few tokens, a long chunk over a prefix, one token
    q = torch.randn(sum(q_lens), 4, 32, generator=torch.Generator().manual_seed(1))
    new = torch.randn(sum(q_lens), 2, 32, generator=torch.Generator().manual_seed(2))
    ctx = Context(is_prefill=True, cu_seqlens_q=torch.tensor([0, 5, 45, 46], dtype=torch.int32),
                  context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=table,
                  has_cached_prefix=True, context_lens_cpu=lens, q_lens_cpu=q_lens)
    backend = TorchBackend()
    got = backend.forward(q, new, new, qk, qv, ctx, 0.2, kv_scales=scales)
    assert torch.equal(got, backend.forward(q, new, new, *dense, ctx, 0.2))

    class DenseOnly(TorchBackend):     # as the CUDA backends: forward hands it dequantized copies of the blocks
        reads_quantized = False

    decode = Context(is_prefill=False, context_lens=ctx.context_lens, block_tables=table, context_lens_cpu=lens)
    want = backend.forward(q[:3], None, None, *dense, decode, 0.2)
    assert torch.equal(backend.forward(q[:3], None, None, qk, qv, decode, 0.2, kv_scales=scales), want)
    assert torch.equal(DenseOnly().forward(q[:3], None, None, qk, qv, decode, 0.2, kv_scales=scales), want)


def test_block_bytes_count_values_and_scales():
    # 4 layers, blocks of 16, 2 KV heads of 32: K and V
    assert kv_block_bytes(4, 16, 2, 32, torch.float32) == 2 * 4 * 16 * 2 * 32 * 4
    assert kv_block_bytes(4, 16, 2, 32, torch.bfloat16) == 2 * 4 * 16 * 2 * 32 * 2
    for kv in QUANTIZED + ["fp8"]:
        assert kv_block_bytes(4, 16, 2, 32, torch.bfloat16, kv) == 2 * 4 * 16 * 2 * (32 + 4)
    # SmolLM2's heads of 64: int8 + scales is 68 bytes a vector against bf16's 128
    assert kv_block_bytes(30, 16, 3, 64, torch.bfloat16) / kv_block_bytes(30, 16, 3, 64, torch.bfloat16, "int8") \
        == pytest.approx(128 / 68)


def test_knob_choices_are_the_formats():
    from dataclasses import fields

    from nanovllm_tp.config.engine_config import EngineConfig
    knob = next(f for f in fields(EngineConfig) if f.name == "kv_cache_dtype").metadata["knob"]
    assert tuple(knob.choices) == tuple(KV_CACHE_DTYPES)


def test_a_backend_without_the_format_is_refused_by_name():
    @register_backend
    class DenseCpu(TorchBackend):
        name = "test-dense-cpu"
        kv_dtypes = ("auto",)

    try:
        assert isinstance(select_backend(torch.device("cpu"), torch.float32, 16, "test-dense-cpu"), DenseCpu)
        with pytest.raises(ValueError, match="kv_cache_dtype='int8' with attention_backend=test-dense-cpu: the "
                                             "test-dense-cpu backend takes kv_cache_dtype 'auto' only"):
            select_backend(torch.device("cpu"), torch.float32, 16, "test-dense-cpu", "int8")
    finally:
        del BACKENDS["test-dense-cpu"]
    assert AttentionBackend.kv_dtypes == ("auto",)       # a new backend takes only what it declares
    for name in ("torch", "cpu"):
        assert type(select_backend(torch.device("cpu"), torch.float32, 16, name, "fp8_e5m2")).reads_quantized
