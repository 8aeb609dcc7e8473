"""The `cpu` backend's C paged-decode kernel against the torch backend's gather + softmax path, its build
cache, and the fallback when it cannot be built."""
import logging
import shutil

import pytest
import torch

from nanovllm_tp.context import Context
from nanovllm_tp.layers import cpu_attention
from nanovllm_tp.layers.attention import TorchBackend
from tests.helpers import random_paged_decode

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def decode_context(lens, table, context_lens) -> Context:
    return Context(is_prefill=False, context_lens=context_lens, block_tables=table, context_lens_cpu=list(lens))


@needs_compiler
@pytest.mark.parametrize("head_dim", [32, 64, 128, 48])          # 48: the kernel's non-specialised path
@pytest.mark.parametrize("group", [1, 2, 4, 20])                  # 20 > 16: query heads done in two chunks
@pytest.mark.parametrize("block_size", [16, 256, 12])
def test_kernel_matches_torch_backend(head_dim, group, block_size):
    torch.manual_seed(head_dim * 1000 + group * 10 + block_size)
    lens = [1, block_size, 2 * block_size, 3 * block_size + 5, block_size - 1, 700]
    q, k_cache, v_cache, table, context_lens = random_paged_decode(lens, block_size, 2, group, head_dim)
    ctx = decode_context(lens, table, context_lens)
    backend = cpu_attention.CpuBackend()
    assert backend.kernel is not None
    scale = head_dim ** -0.5
    got = backend.forward(q, None, None, k_cache, v_cache, ctx, scale)
    want = TorchBackend().forward(q, None, None, k_cache, v_cache, ctx, scale)
    assert got.shape == want.shape == q.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@needs_compiler
def test_kernel_padding_row_and_thread_counts_agree():
    torch.manual_seed(0)
    lens = [0, 5, 300, 17, 64, 1, 129, 0]
    q, k_cache, v_cache, table, context_lens = random_paged_decode(lens, 16, 4, 2, 64)
    ctx = decode_context(lens, table, context_lens)
    backend = cpu_attention.CpuBackend()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = backend.forward(q, None, None, k_cache, v_cache, ctx, 0.125)
        torch.set_num_threads(2)
        two = backend.forward(q, None, None, k_cache, v_cache, ctx, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two), "each (row, kv head) is computed by one thread: no order dependence"
    assert torch.count_nonzero(one[[0, 7]]) == 0, "a zero-length row attends to nothing"
    live = [i for i, n in enumerate(lens) if n]
    want = TorchBackend().forward(q[live], None, None, k_cache, v_cache,
                                  decode_context([lens[i] for i in live], table[live], context_lens[live]), 0.125)
    torch.testing.assert_close(one[live], want, rtol=1e-5, atol=2e-6)


@needs_compiler
def test_kernel_reads_only_the_rows_blocks():
    """Blocks that no row owns are poisoned with NaN: the kernel must never touch them."""
    torch.manual_seed(1)
    lens = [33, 16, 7]
    q, k_cache, v_cache, table, context_lens = random_paged_decode(lens, 16, 2, 2, 32, spare_blocks=6)
    owned = set(table[table >= 0].tolist())
    for block in set(range(k_cache.shape[0])) - owned:
        k_cache[block] = float("nan")
        v_cache[block] = float("nan")
    out = cpu_attention.CpuBackend().forward(q, None, None, k_cache, v_cache, decode_context(lens, table, context_lens),
                                             32 ** -0.5)
    assert torch.isfinite(out).all()


@needs_compiler
def test_build_is_cached_per_source(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = shutil.which("cc")
    first = cpu_attention.build_kernel(compiler)
    assert first.parent == tmp_path / "nanovllm_tp" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert cpu_attention.build_kernel(compiler) == first and first.stat().st_mtime_ns == stamp, "no rebuild"
    assert [p.name for p in first.parent.iterdir()] == [first.name], "no temporary files left behind"


def test_without_a_compiler_decode_falls_back_to_torch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_attention.load_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="nanovllm_tp"):
            backend = cpu_attention.CpuBackend()
    finally:
        cpu_attention.load_kernel.cache_clear()
    assert backend.kernel is None
    assert "no C compiler" in caplog.text
    torch.manual_seed(2)
    lens = [3, 40]
    q, k_cache, v_cache, table, context_lens = random_paged_decode(lens, 16, 2, 2, 32)
    ctx = decode_context(lens, table, context_lens)
    got = backend.forward(q, None, None, k_cache, v_cache, ctx, 0.2)
    assert torch.equal(got, TorchBackend().forward(q, None, None, k_cache, v_cache, ctx, 0.2))


@needs_compiler
def test_failed_build_is_reported_and_falls_back(tmp_path, monkeypatch, caplog):
    """A compiler that exits non-zero: a warning carrying its message, and no kernel."""
    fake = tmp_path / "badcc"
    fake.write_text("#!/bin/sh\necho 'badcc: out of licences' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake))
    cpu_attention.load_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="nanovllm_tp"):
            assert cpu_attention.load_kernel() is None
    finally:
        cpu_attention.load_kernel.cache_clear()
    assert "out of licences" in caplog.text


def test_other_dtypes_use_the_torch_path():
    torch.manual_seed(3)
    lens = [9, 20]
    q, k_cache, v_cache, table, context_lens = random_paged_decode(lens, 16, 2, 2, 32)
    q, k_cache, v_cache = (t.to(torch.bfloat16) for t in (q, k_cache, v_cache))
    ctx = decode_context(lens, table, context_lens)
    got = cpu_attention.CpuBackend().forward(q, None, None, k_cache, v_cache, ctx, 0.2)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, TorchBackend().forward(q, None, None, k_cache, v_cache, ctx, 0.2))
