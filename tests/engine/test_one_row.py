"""csrc/linear_q.c with one row (a decode step's matmul): its outputs are the batched path's for the same row,
whatever the thread count, with a last unit that is not whole; and `bench kernels --one-row`, which times it."""
import numpy as np
import pytest
import torch

from nanovllm_tp.bench.kernels import random_raw_blocks
from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.quant import GGUF_TYPES, QuantBlocks, QuantWeight, pack_blocks

KERNEL_TYPES = cpu_kernels.load().quant_types if cpu_kernels.load() else ()
TYPES = [name for code, name in GGUF_TYPES.items() if code in KERNEL_TYPES]


@pytest.mark.skipif(not TYPES, reason="csrc/linear_q.c needs AVX-512 VNNI")
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n", [32 * 37 + 5, 40])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_row_is_the_batched_row(name, n, threads):
    code = {v: c for c, v in GGUF_TYPES.items()}[name]
    k = 512
    packed = pack_blocks(QuantBlocks(random_raw_blocks(n, k, code, np.random.default_rng(n)), code, k))
    assert isinstance(packed, QuantWeight)
    kernels = cpu_kernels.load()
    g = torch.Generator().manual_seed(threads)
    x, bias = torch.randn(3, k, generator=g), torch.randn(n, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            batched = kernels.linear_quant(x.to(dtype), packed.data, code, n, bias)
            for r in range(3):
                one = kernels.linear_quant(x[r:r + 1].to(dtype), packed.data, code, n, bias)
                tol = 1e-5 if dtype is torch.float32 else 2 ** -7
                assert torch.allclose(one[0].float(), batched[r].float(), rtol=tol, atol=tol * batched.abs().max())
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not TYPES, reason="csrc/linear_q.c needs AVX-512 VNNI")
def test_one_row_bench_reports_each_type_it_runs(monkeypatch):
    """`bench kernels --one-row`: a figure for every type the kernels run here (and bf16 where linear.c does), none
    for a type they do not."""
    from nanovllm_tp.bench import kernels as bench
    monkeypatch.setattr(bench, "ONE_ROW_BYTES", 1 << 20)
    rates = bench.one_row_rates([TYPES[0]], threads=1, repeats=2)
    assert set(rates) <= {TYPES[0], "bf16"} and TYPES[0] in rates
    assert all(r["gb_s"] >= r["median_gb_s"] > 0 and r["bytes"] >= 1 << 20 for r in rates.values())
    # each pass paired with a read of the read rate's buffer: the share is a ratio of the same moment's figures
    assert all(r["read_gb_s"] > 0 and 0 < r["share"] for r in rates.values())


def test_a_read_sample_reads_the_read_rates_buffer():
    """bandwidth.read_sampler reads read_bandwidth's buffer once a call, at its best configuration, and returns
    GB/s within a factor of that figure (both sane: the same reads)."""
    from nanovllm_tp.bench import bandwidth
    sample = bandwidth.read_sampler(1)
    best = bandwidth.read_bandwidth(1)
    rates = [sample() for _ in range(3)]
    assert all(0.1 < r < 1000 for r in rates)
    assert max(rates) > best["gb_s"] / 4
