"""The C paged decode kernel's two forms (csrc/decode_attn_simd.c's AVX-512 form and csrc/decode_attn.c's portable
loop), each against attention computed directly in torch (float64) over the same cache contents: every
kv_cache_dtype, block sizes that are and are not multiples of the kernel's 16-key chunks, lengths that are not
either, GQA ratios 1, 3 and 4, windows and soft caps, many rows; and the vector form's thread split."""
import shutil

import pytest
import torch

from nanovllm_tp.layers import cpu_features, cpu_kernels
from nanovllm_tp.layers.attention.kv_quant import KV_CACHE_DTYPES, quantize
from tests.helpers import random_paged_cache
from tests.kv_reference import query_as_read

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
FORMS = [False, True]           # paged_decode's `portable`
FORM_IDS = ["vector", "portable"]
# lengths: empty, one token, around the 16-key chunks and the blocks, long
LENGTHS = [0, 1, 5, 15, 16, 17, 31, 33, 47, 64, 100, 129, 250, 301]


def cache(lens, block_size, kv_heads, head_dim, kv, seed):
    """(k, v, kv_scales or None, table) in format kv ("float32", "bfloat16" or a quantized kv_cache_dtype)."""
    k, v, table = random_paged_cache(lens, block_size, kv_heads, head_dim, seed=seed)
    if kv in ("float32", "bfloat16"):
        return k.to(getattr(torch, kv)), v.to(getattr(torch, kv)), None, table
    (qk, ks), (qv, vs) = quantize(k, KV_CACHE_DTYPES[kv]), quantize(v, KV_CACHE_DTYPES[kv])
    return qk, qv, (ks, vs), table


def direct(q, k, v, kv_scales, table, lens, scale, window=0, softcap=0.0) -> torch.Tensor:
    """Each row's attention in float64 over its visible tokens, K/V read as the cache holds them (values times
    their scales), GQA by repeating each KV head over its query heads; zeros for a row of no tokens."""
    k, v = k.double(), v.double()
    if kv_scales is not None:
        k, v = k * kv_scales[0].double().unsqueeze(-1), v * kv_scales[1].double().unsqueeze(-1)
    block_size, group = k.shape[1], q.shape[1] // k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r, n in enumerate(lens):
        if n == 0:
            continue
        first = n - window if 0 < window < n else 0
        pos = torch.arange(first, n)
        blocks = table[r, pos // block_size].long()
        keys = k[blocks, pos % block_size].repeat_interleave(group, 1)         # [tokens, heads, dim]
        values = v[blocks, pos % block_size].repeat_interleave(group, 1)
        s = torch.einsum("hd,thd->ht", q[r].double(), keys) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        out[r] = torch.einsum("ht,thd->hd", s.softmax(-1), values)
    return out


def as_read(q, kv, portable) -> torch.Tensor:
    """q as the kernel reads it (query_as_read), for this form."""
    return q if portable else query_as_read(q, kv)


def run(q, k, v, kv_scales, table, lens, scale, portable, window=0, softcap=0.0):
    return cpu_kernels.load().paged_decode(q, k, v, table, torch.tensor(lens, dtype=torch.int32), scale, window,
                                           softcap, kv_scales, portable=portable)


def tolerance(q_dtype):
    # fp32: sums in another order; bf16 queries: the output is rounded to bf16 (values of size ~1)
    return dict(rtol=2e-5, atol=4e-6) if q_dtype is torch.float32 else dict(rtol=2 ** -7, atol=2 ** -8)


@needs_compiler
@pytest.mark.parametrize("portable", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 12, 40])
def test_each_form_and_format_matches_direct_attention(block_size, group, kv, portable):
    kv_heads, head_dim = 2, 64
    k, v, kv_scales, table = cache(LENGTHS, block_size, kv_heads, head_dim, kv, seed=block_size * 10 + group)
    q_dtype = torch.bfloat16 if kv == "bfloat16" else torch.float32
    q = torch.randn(len(LENGTHS), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(group))
    q = q.to(q_dtype)
    got = run(q, k, v, kv_scales, table, LENGTHS, head_dim ** -0.5, portable)
    assert got.dtype is q_dtype and got.shape == q.shape
    want = direct(as_read(q, kv, portable), k, v, kv_scales, table, LENGTHS, head_dim ** -0.5)
    torch.testing.assert_close(got.double(), want, **tolerance(q_dtype))
    assert not got[0].any(), "a row of no tokens attends to nothing"


@needs_compiler
@pytest.mark.parametrize("head_dim", [32, 128, 256, 48])       # 48: no vector form, the portable loop runs
@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
def test_head_dims(head_dim, kv):
    lens = [3, 16, 70, 200]
    k, v, kv_scales, table = cache(lens, 16, 1, head_dim, kv, seed=head_dim)
    q = torch.randn(len(lens), 3, head_dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = direct(q, k, v, kv_scales, table, lens, head_dim ** -0.5)
    for portable in FORMS:
        got = run(q, k, v, kv_scales, table, lens, head_dim ** -0.5, portable)
        torch.testing.assert_close(got.double(), want, **tolerance(torch.bfloat16))


@needs_compiler
@pytest.mark.parametrize("kv", ["bfloat16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("window,softcap", [(20, 0.0), (37, 0.0), (0, 3.0), (50, 2.0), (90, 0.0)])
@pytest.mark.parametrize("block_size", [16, 40])
def test_windows_and_soft_caps(kv, window, softcap, block_size):
    """A window that starts inside a block and inside a 16-key chunk (so a span of four chunks starts there too);
    Gemma 2's soft cap."""
    k, v, kv_scales, table = cache(LENGTHS, block_size, 3, 64, kv, seed=window)
    q_dtype = torch.bfloat16 if kv == "bfloat16" else torch.float32
    q = torch.randn(len(LENGTHS), 9, 64, generator=torch.Generator().manual_seed(2)).to(q_dtype)
    for portable in FORMS:
        want = direct(as_read(q, kv, portable), k, v, kv_scales, table, LENGTHS, 0.125, window, softcap)
        got = run(q, k, v, kv_scales, table, LENGTHS, 0.125, portable, window, softcap)
        torch.testing.assert_close(got.double(), want, **tolerance(q_dtype))


@needs_compiler
@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
def test_thread_split_does_not_change_the_output(kv):
    """Fewer rows than threads: the vector form splits a row's KV heads over threads, else whole rows; each head's
    sums are the same either way, so the outputs are equal bit for bit."""
    lens = [300, 17, 64]
    k, v, kv_scales, table = cache(lens, 16, 3, 64, kv, seed=5)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [run(q[i:i + 1], k, v, kv_scales, table[i:i + 1], lens[i:i + 1], 0.125, False) for i in range(3)]
        whole = run(q, k, v, kv_scales, table, lens, 0.125, False)
        torch.set_num_threads(4)         # more threads than rows: heads split
        split = run(q, k, v, kv_scales, table, lens, 0.125, False)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.cat(one), whole) and torch.equal(whole, split)


@needs_compiler
def test_vector_form_is_built_where_the_cpu_has_avx512():
    if "avx512bw" not in cpu_features.cpu_flags():
        pytest.skip("no AVX-512 here: the portable loop is the only form")
    assert cpu_kernels.load().decode_simd


@needs_compiler
@pytest.mark.parametrize("portable", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_every_fp8_code_widens_as_torch_casts_it(kv, portable):
    """Rows of one token whose V holds every finite code (subnormals included): the output is V times its scale
    exactly, so each code's value shows (a scaled store writes no NaN or inf)."""
    dtype = KV_CACHE_DTYPES[kv]
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[codes.view(dtype).float().isfinite()]
    codes = torch.cat([codes, torch.zeros(-len(codes) % 32, dtype=torch.uint8)])
    rows = len(codes) // 32                      # head_dim 32: one row's V is 32 codes, each row its own block
    v = codes.view(rows, 1, 1, 32).view(dtype).contiguous()
    k = torch.zeros_like(v)
    scale = torch.full((rows, 1, 1), 0.5)
    q = torch.randn(rows, 1, 32, generator=torch.Generator().manual_seed(4))
    table = torch.arange(rows, dtype=torch.int32)[:, None]
    out = run(q, k, v, (scale, scale), table, [1] * rows, 1.0, portable)
    assert torch.equal(out[:, 0], v[:, 0, 0].float() * 0.5)
