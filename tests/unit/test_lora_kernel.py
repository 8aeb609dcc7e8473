"""csrc/lora.c on its own against a direct torch computation, token by token: y[t] + B_s (A_s x[t]) for each
token's slot s, with the slot tables in fp32 or bf16 under fp32 or bf16 activations (the torch side takes the
same bf16 values, every sum in fp32), adapters of mixed ranks (above 16: several blocks of rank rows; 0: a part
left alone), tokens of no adapter (-1) untouched, a slot's tokens scattered over the step (grouped by the
kernel), many tokens, input and output widths that are not multiples of 16, strided rows; then the plain-C
build (no AVX-512) on the same cases."""
import os

import numpy as np
import pytest
import torch

from nanovllm_tp.layers import cpu_build, cpu_kernels
from nanovllm_tp.lora.layers import LoRATables, SlotGroups

PARTS = (40, 24, 24)          # a qkv-like layer: three parts of outputs


def tables(gen, slots: int, R: int, fan_in: int, ranks, dtype):
    """A, B (B^T) [slots, parts * R, ...] zero beyond each slot's rank per part, and the ranks [slots, parts]."""
    out = sum(PARTS)
    A = torch.zeros(slots, len(PARTS) * R, fan_in)
    B = torch.zeros(slots, len(PARTS) * R, out)
    bounds = np.cumsum([0, *PARTS])
    for s in range(slots):
        for p, r in enumerate(ranks[s]):
            A[s, p * R:p * R + r] = torch.randn(r, fan_in, generator=gen)
            B[s, p * R:p * R + r, bounds[p]:bounds[p + 1]] = torch.randn(r, PARTS[p], generator=gen)
    return A.to(dtype), B.to(dtype), torch.tensor(ranks, dtype=torch.int64), torch.tensor(bounds, dtype=torch.int64)


def direct(x, y, A, B, token_slots) -> torch.Tensor:
    """y + (x A_s^T) B_s in fp32 from the operands' own values, rounded to y's dtype once."""
    want = y.float().clone()
    for t, s in enumerate(token_slots):
        if s >= 0:
            want[t] += (A[s].float() @ x[t].float()) @ B[s].float()
    return want.to(y.dtype)


def run_case(kernels, seed: int, token_slots, *, act=torch.float32, lora=torch.float32, R=16, fan_in=72,
             ranks=None, stride_pad=0):
    gen = torch.Generator().manual_seed(seed)
    slots = max(max(token_slots) + 1, 1)
    ranks = ranks or [[R, R // 2, R][:len(PARTS)]] * slots
    A, B, ranks_t, bounds = tables(gen, slots, R, fan_in, ranks, lora)
    n = len(token_slots)
    x_wide = torch.randn(n, fan_in + stride_pad, generator=gen).to(act)
    x = x_wide[:, :fan_in]                               # rows x_stride apart
    y = torch.randn(n, sum(PARTS), generator=gen).to(act)
    want = direct(x, y, A, B, token_slots)
    got = y.clone()
    groups = SlotGroups.of(np.asarray(token_slots, np.int64))
    kernels.lora_apply(LoRATables.of(A, B, ranks_t, bounds, R), groups, x, got)
    for t, s in enumerate(token_slots):
        if s < 0:
            assert torch.equal(got[t], y[t]), f"token {t} has no adapter but changed"
    if act is torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:                    # one bf16 rounding of y each side, the sums in another order
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=0.1)
        assert (got.float() - want.float()).abs().max() <= 2 * 2 ** -8 * want.float().abs().max() + 1e-2
    return got


CASES = {
    "decode, every row its own slot": dict(token_slots=[0, 1, 2, 3, 4, 5, 6, 7]),
    "rows sharing slots, scattered, and base rows": dict(token_slots=[2, -1, 0, 2, 1, -1, 0, 2, 2, 1]),
    "many tokens (prompt chunks)": dict(token_slots=[1] * 70 + [-1] * 9 + [0] * 33 + [1] * 5),
    "mixed ranks, one part left alone": dict(token_slots=[0, 1, 2, 1, 0], R=32,
                                             ranks=[[32, 5, 17], [1, 0, 16], [9, 31, 0]]),
    "inputs not a multiple of 16, strided rows": dict(token_slots=[1, 0, -1, 1], fan_in=37, stride_pad=11),
    "no adapted token": dict(token_slots=[-1, -1]),
}
DTYPES = {"fp32": (torch.float32, torch.float32), "fp32 act, bf16 adapters": (torch.float32, torch.bfloat16),
          "bf16": (torch.bfloat16, torch.bfloat16), "bf16 act, fp32 adapters": (torch.bfloat16, torch.float32)}


@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_direct_torch(case, dtypes):
    kernels = cpu_kernels.load()
    act, lora = DTYPES[dtypes]
    run_case(kernels, list(CASES).index(case), act=act, lora=lora, **CASES[case])


def test_bf16_adapters_under_fp32_activations_are_not_the_fp32_result():
    """The bf16 tables change the sums (they are rounded adapters, not peft's fp32 ones), by a bf16 step."""
    kernels = cpu_kernels.load()
    slots = [0, 1, 2]
    exact = run_case(kernels, 7, slots, lora=torch.float32)
    rounded = run_case(kernels, 7, slots, lora=torch.bfloat16)
    diff = (exact - rounded).abs().max().item()
    assert 0 < diff < 0.05 * exact.abs().max().item()


@pytest.fixture(scope="module")
def plain_kernels(tmp_path_factory):
    """The library built without AVX-512 (the fallback other CPUs get)."""
    if os.system("cc --version > /dev/null 2>&1"):
        pytest.skip("no C compiler")
    flags = cpu_build.CFLAGS
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("plain-build")))
        mp.setattr(cpu_build, "CFLAGS", [f for f in flags if f != "-march=native"])
        kernels = cpu_kernels.CpuKernels(cpu_build.build_library(cpu_build.compiler()))
    assert not kernels.linear_dtypes, "built with AVX-512 all the same"
    return kernels


@pytest.mark.parametrize("dtypes", ["fp32", "fp32 act, bf16 adapters", "bf16"])
def test_plain_c_fallback_equals_direct_torch(plain_kernels, dtypes):
    act, lora = DTYPES[dtypes]
    for i, case in enumerate(("rows sharing slots, scattered, and base rows", "mixed ranks, one part left alone",
                              "inputs not a multiple of 16, strided rows")):
        run_case(plain_kernels, i, act=act, lora=lora, **CASES[case])
