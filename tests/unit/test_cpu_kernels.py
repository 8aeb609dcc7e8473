"""The C kernels for fp32 and bf16 on CPU against the torch code they replace: paged decode (the torch backend's gather +
softmax), RMSNorm with and without the residual, RoPE on strided head views, SiLU-and-mul; their build cache,
and the fallback to torch when they cannot be built or are switched off."""
import logging
import shutil

import pytest
import torch

from nanovllm_tp.layers import cpu_build, cpu_kernels
from nanovllm_tp.layers.attention.cpu_paged import CpuBackend
from nanovllm_tp.layers.attention.torch_sdpa import TorchBackend
from nanovllm_tp.utils.context import Context
from tests.helpers import random_paged_decode

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
DTYPES = [torch.float32, torch.bfloat16]
# Elementwise: the kernel rounds to bf16 once where the torch code rounds twice (e.g. x * rsqrt rounded, then
# times the weight), so they may differ by ~1.5 bf16 ulps (2**-8 each): rtol 2**-7. fp32 differs only in order.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=1e-4)}


def decode_context(lens, table, context_lens) -> Context:
    return Context(is_prefill=False, context_lens=context_lens, block_tables=table, context_lens_cpu=list(lens))


@needs_compiler
@pytest.mark.parametrize("head_dim", [32, 64, 128, 48])          # 48: the kernel's non-specialised path
@pytest.mark.parametrize("group", [1, 2, 4, 20])                  # 20 > 16: query heads done in two chunks
@pytest.mark.parametrize("block_size", [16, 256, 12])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_torch_backend(head_dim, group, block_size, dtype):
    lens = [1, block_size, 2 * block_size, 3 * block_size + 5, block_size - 1, 700]
    q, k_cache, v_cache, table, context_lens = random_paged_decode(lens, block_size, 2, group, head_dim,
                                                                   seed=head_dim * 1000 + group * 10 + block_size)
    q, k_cache, v_cache = (t.to(dtype) for t in (q, k_cache, v_cache))
    ctx = decode_context(lens, table, context_lens)
    backend = CpuBackend()
    assert cpu_kernels.load() is not None
    scale = head_dim ** -0.5
    got = backend.forward(q, None, None, k_cache, v_cache, ctx, scale)
    want = TorchBackend().forward(q, None, None, k_cache, v_cache, ctx, scale)
    assert got.shape == want.shape == q.shape and got.dtype == dtype
    # bf16: the torch backend rounds the scores and the probabilities to bf16 (the kernel keeps both in fp32) and
    # sums p * v in bf16 matmuls; outputs are averages of values of size ~1, so an absolute 2**-6 bounds that
    tolerance = dict(rtol=1e-5, atol=2e-6) if dtype is torch.float32 else dict(rtol=2 ** -6, atol=2 ** -6)
    torch.testing.assert_close(got, want, **tolerance)


@needs_compiler
def test_kernel_padding_row_and_thread_counts_agree():
    lens = [0, 5, 300, 17, 64, 1, 129, 0]
    q, k_cache, v_cache, table, context_lens = random_paged_decode(lens, 16, 4, 2, 64, seed=0)
    ctx = decode_context(lens, table, context_lens)
    backend = CpuBackend()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = backend.forward(q, None, None, k_cache, v_cache, ctx, 0.125)
        torch.set_num_threads(2)
        two = backend.forward(q, None, None, k_cache, v_cache, ctx, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two), "each row is computed by one thread: no order dependence"
    assert torch.count_nonzero(one[[0, 7]]) == 0, "a zero-length row attends to nothing"
    live = [i for i, n in enumerate(lens) if n]
    want = TorchBackend().forward(q[live], None, None, k_cache, v_cache,
                                  decode_context([lens[i] for i in live], table[live], context_lens[live]), 0.125)
    torch.testing.assert_close(one[live], want, rtol=1e-5, atol=2e-6)


@needs_compiler
def test_kernel_reads_only_the_rows_blocks():
    """Blocks that no row owns are poisoned with NaN: the kernel must never touch them."""
    lens = [33, 16, 7]
    q, k_cache, v_cache, table, context_lens = random_paged_decode(lens, 16, 2, 2, 32, spare=6, seed=1)
    owned = set(table[table >= 0].tolist())
    for block in set(range(k_cache.shape[0])) - owned:
        k_cache[block] = float("nan")
        v_cache[block] = float("nan")
    out = CpuBackend().forward(q, None, None, k_cache, v_cache, decode_context(lens, table, context_lens),
                                             32 ** -0.5)
    assert torch.isfinite(out).all()


@pytest.mark.slow
@needs_compiler
def test_build_is_cached_per_source(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = shutil.which("cc")
    first = cpu_build.build_library(compiler)
    assert first.parent == tmp_path / "nanovllm_tp" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert cpu_build.build_library(compiler) == first and first.stat().st_mtime_ns == stamp, "no rebuild"
    assert [p.name for p in first.parent.iterdir()] == [first.name], "no temporary files left behind"


def test_without_a_compiler_decode_falls_back_to_torch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="nanovllm_tp"):
            assert cpu_kernels.load() is None
        assert "no C compiler" in caplog.text
        lens = [3, 40]
        q, k_cache, v_cache, table, context_lens = random_paged_decode(lens, 16, 2, 2, 32, seed=2)
        ctx = decode_context(lens, table, context_lens)
        got = CpuBackend().forward(q, None, None, k_cache, v_cache, ctx, 0.2)
        assert torch.equal(got, TorchBackend().forward(q, None, None, k_cache, v_cache, ctx, 0.2))
    finally:
        cpu_kernels.load.cache_clear()


@needs_compiler
def test_failed_build_is_reported_and_falls_back(tmp_path, monkeypatch, caplog):
    """A compiler that exits non-zero: a warning carrying its message, and no kernel."""
    fake = tmp_path / "badcc"
    fake.write_text("#!/bin/sh\necho 'badcc: out of licences' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake))
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="nanovllm_tp"):
            assert cpu_kernels.load() is None
    finally:
        cpu_kernels.load.cache_clear()
    assert "out of licences" in caplog.text


def test_other_dtypes_use_the_torch_path():
    lens = [9, 20]
    q, k_cache, v_cache, table, context_lens = random_paged_decode(lens, 16, 2, 2, 32, seed=3)
    q, k_cache, v_cache = (t.to(torch.float16) for t in (q, k_cache, v_cache))
    ctx = decode_context(lens, table, context_lens)
    got = CpuBackend().forward(q, None, None, k_cache, v_cache, ctx, 0.2)
    assert got.dtype == torch.float16
    assert torch.equal(got, TorchBackend().forward(q, None, None, k_cache, v_cache, ctx, 0.2))


# ---------------------------------------------------------------- layer kernels vs the layers' torch code

@needs_compiler
@pytest.mark.parametrize("tokens", [1, 7, 700])        # 700 x 128 crosses the kernels' threading threshold
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(both_paths, tokens, dtype):
    from nanovllm_tp.layers.norm_rope_act import RMSNorm
    torch.manual_seed(tokens)
    norm = RMSNorm(128, eps=1e-6).to(dtype)
    norm.weight.data.normal_(1.0, 0.1)
    x, residual = (torch.randn(tokens, 128) * 3).to(dtype), torch.randn(tokens, 128).to(dtype)

    def run():
        plain = norm(x.clone())
        res = residual.clone()
        normed, summed = norm(x.clone(), res)
        assert summed.data_ptr() == res.data_ptr(), "the sum is written into the residual buffer"
        return plain, normed, summed

    (plain, normed, summed), (plain_ref, normed_ref, summed_ref) = both_paths(run)
    assert plain.dtype == normed.dtype == dtype
    torch.testing.assert_close(plain, plain_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(normed, normed_ref, **TOLERANCE[dtype])
    assert torch.equal(summed, summed_ref) and torch.equal(summed, x + residual)


@needs_compiler
def test_rms_norm_on_heads_sliced_from_a_fused_projection(both_paths):
    """Qwen3's q/k norms see [tokens, heads, dim] views whose rows are strided by the whole qkv width."""
    from nanovllm_tp.layers.norm_rope_act import RMSNorm
    torch.manual_seed(5)
    norm = RMSNorm(32)
    norm.weight.data.normal_(1.0, 0.1)
    qkv = torch.randn(9, (4 + 2 + 2) * 32)
    q = qkv[:, :128].view(9, 4, 32)
    k = qkv[:, 128:192].view(9, 2, 32)
    before = qkv.clone()
    (q_fast, k_fast), (q_ref, k_ref) = both_paths(lambda: (norm(q), norm(k)))
    assert torch.equal(qkv, before), "the norm writes a new tensor, never the projection output"
    torch.testing.assert_close(q_fast, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_fast, k_ref, rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize("dtype, table_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])     # Phi-4-mini rotates 3/4
def test_rope_on_strided_views(both_paths, head_dim, dtype, table_dtype, partial):
    from nanovllm_tp.layers.norm_rope_act import RotaryEmbedding
    torch.manual_seed(head_dim)
    rotary_dim = head_dim * 3 // 4 if partial else 0
    rope = RotaryEmbedding(head_dim, max_position=4096, base=1e6, rotary_dim=rotary_dim).to(table_dtype)
    tokens, heads, kv_heads = 11, 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.tensor([0, 1, 2, 3, 100, 101, 2000, 4095, 7, 7, 50])

    def run():
        fresh = qkv.clone()
        q = fresh[:, :heads * head_dim].view(tokens, heads, head_dim)
        k = fresh[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        v_before = fresh[:, (heads + kv_heads) * head_dim:].clone()
        q, k = rope(positions, q, k)
        assert torch.equal(fresh[:, (heads + kv_heads) * head_dim:], v_before), "v is never touched"
        return q.clone(), k.clone()

    (q_fast, k_fast), (q_ref, k_ref) = both_paths(run)
    assert q_fast.dtype == dtype
    torch.testing.assert_close(q_fast, q_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(k_fast, k_ref, **TOLERANCE[dtype])
    assert torch.equal(q_fast[0], qkv[0, :heads * head_dim].view(heads, head_dim)), "position 0 is the identity"
    if partial:
        q_in = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
        assert torch.equal(q_fast[..., rotary_dim:], q_in[..., rotary_dim:]), "features past rotary_dim stay"
        assert not torch.equal(q_fast[1:, :, :rotary_dim], q_in[1:, :, :rotary_dim])


@needs_compiler
@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(both_paths, tokens, dtype):
    from nanovllm_tp.layers.norm_rope_act import SiluAndMul
    torch.manual_seed(tokens)
    x = (torch.randn(tokens, 2 * 384) * 4).to(dtype)
    fast, reference = both_paths(lambda: SiluAndMul()(x))
    assert fast.shape == (tokens, 384) and fast.dtype == dtype
    torch.testing.assert_close(fast, reference, **TOLERANCE[dtype])


@needs_compiler
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_uses_the_kernels_and_matches_with_them_off(tiny_model_dir, both_paths, dtype):
    """The whole tiny model, greedy, with the C kernels and with plain torch: same tokens in fp32. In bf16 the two
    round differently (the kernels once, in fp32, the torch ops after each op), so where the random tiny model's
    top two logits nearly tie greedy may flip: tokens agree up to a position where both choices are within a
    bf16-sized margin in the reference, and the chosen tokens' logprobs agree before it."""
    from nanovllm_tp import LLM, SamplingParams
    from tests.helpers import mixed_prompts
    prompts = mixed_prompts(2003, lengths=(1, 30, 170))

    def run():    # a small token budget, so mixed steps (decode rows next to prompt chunks) happen too
        llm = LLM(tiny_model_dir, device="cpu", dtype=dtype, kv_cache_memory=32 << 20, max_num_batched_tokens=64)
        try:
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
            out = llm.generate(prompts, params, use_tqdm=False)
            assert llm.engine.scheduler.num_mixed_steps > 0
        finally:
            llm.close()
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out]

    fast, reference = both_paths(run)
    if dtype == "float32":
        assert [f[0] for f in fast] == [r[0] for r in reference]
        return
    # bf16 activations and weights move this model's logprobs by up to ~0.3 nats against fp32, with kernels or
    # without (measured: the kernels' bf16 run keeps 72/72 fp32 greedy tokens, the torch ops' 57/72)
    margin = 0.4
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(fast, reference):
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
        for i in range(same):
            assert abs(logprobs[i][tokens[i]].logprob - ref_logprobs[i][tokens[i]].logprob) < margin
        if same < len(tokens):
            top = ref_logprobs[same][ref_tokens[same]].logprob
            assert tokens[same] in ref_logprobs[same], "the flipped choice is the reference's runner-up"
            assert top - ref_logprobs[same][tokens[same]].logprob < margin, "a near tie in the reference"
