"""The batched low-rank matmul of nanovllm_tp/lora/layers.py on its own: a decode step whose rows run different
adapters (and none), through csrc/lora.c and through torch's runs of one slot, equals y + scale * (x A^T) B^T computed row by row;
packed q/k/v parts keep to their rows; a prefill step's runs of one slot take the same sums."""
import numpy as np
import pytest
import torch

from nanovllm_tp.layers.linear import QKVParallelLinear, RowParallelLinear
from nanovllm_tp.lora.layers import LoRABatch, LoRALayer

SLOTS, RANK = 3, 8


def adapters(layer: LoRALayer, gen) -> dict:
    """Random adapters in every slot (ranks 8, 4 and 2; slot 2 leaves the k part alone): slot -> part -> (A, B)."""
    made = {}
    for slot, r in enumerate((8, 4, 2)):
        layer.clear(slot)
        made[slot] = {}
        for part in range(len(layer.parts)):
            if slot == 2 and part == 1:
                continue
            fan_in, fan_out = layer.full_shape(part)
            a, b = torch.randn(r, fan_in, generator=gen), torch.randn(fan_out, r, generator=gen)
            layer.load(slot, part, a, b, 0.5)
            made[slot][part] = (a, b)
    return made


def expected(layer: LoRALayer, made, x, y, slots) -> torch.Tensor:
    want = y.clone()
    rows = layer.part_rows.tolist()
    for t, slot in enumerate(slots):
        for part, (a, b) in made.get(slot, {}).items():
            want[t, rows[part]:rows[part + 1]] += 0.5 * (b @ (a @ x[t]))
    return want


@pytest.mark.parametrize("kind", ["qkv", "row"])
def test_decode_rows_of_different_adapters(kind, both_paths):
    gen = torch.Generator().manual_seed(0)
    base = QKVParallelLinear(64, 16, 4, 2) if kind == "qkv" else RowParallelLinear(48, 40)
    slots = [0, -1, 2, 1, 0, 2]
    batch = LoRABatch(kernel=True)
    layer = LoRALayer(base, (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")) if kind == "qkv" else
                      (("o_proj", None),), batch, SLOTS, RANK)
    made = adapters(layer, gen)
    x = torch.randn(len(slots), base.weight.shape[1], generator=gen)
    y = torch.randn(len(slots), base.weight.shape[0], generator=gen)
    want = expected(layer, made, x, y, slots)

    def run():
        batch.kernel = True
        batch.set(np.array(slots, np.int32), np.arange(len(slots) + 1, dtype=np.int32))
        return layer.apply(x, y.clone())
    fast, reference = both_paths(run)
    torch.testing.assert_close(fast, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(reference, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("lens", [(3, 2, 4, 5), (30, 2, 40, 50)])
def test_prefill_rows_of_several_tokens(lens, both_paths):
    gen = torch.Generator().manual_seed(1)
    base = RowParallelLinear(32, 24)
    batch = LoRABatch(kernel=True)
    layer = LoRALayer(base, (("down_proj", None),), batch, SLOTS, RANK)
    made = adapters(layer, gen)
    slots = [1, 1, -1, 0]                            # rows 0 and 1 make one run
    cu = np.cumsum([0, *lens]).astype(np.int32)
    batch.set(np.array(slots, np.int32), cu)
    assert batch.runs == [(1, 0, int(cu[2])), (0, int(cu[3]), int(cu[4]))]
    groups = batch.groups                                     # the kernel's form: tokens by slot
    if lens[0] == 30:                                         # more than 16 tokens a slot: matmuls, not the kernel
        assert groups.slots.tolist() == [] and batch.heavy == batch.runs
    else:
        assert groups.slots.tolist() == [0, 1] and groups.starts.tolist() == [0, lens[3], lens[3] + lens[0] + lens[1]]
    x, y = torch.randn(int(cu[-1]), 32, generator=gen), torch.randn(int(cu[-1]), 24, generator=gen)
    token_slots = [s for s, n in zip(slots, lens) for _ in range(n)]
    want = expected(layer, made, x, y, token_slots)
    for got in both_paths(lambda: layer.apply(x, y.clone())):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_bf16_decode_rows_through_the_kernel_and_torch(both_paths):
    gen = torch.Generator().manual_seed(2)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        base = QKVParallelLinear(64, 16, 4, 2)
    finally:
        torch.set_default_dtype(previous)
    batch = LoRABatch(kernel=True)
    layer = LoRALayer(base, (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")), batch, SLOTS, RANK)
    made = adapters(layer, gen)
    slots = [2, 0, -1, 1]
    x = torch.randn(4, 64, generator=gen).bfloat16()
    y = torch.randn(4, base.weight.shape[0], generator=gen).bfloat16()
    rounded = {s: {p: (a.bfloat16().float(), (b * 0.5).bfloat16().float() / 0.5) for p, (a, b) in parts.items()}
               for s, parts in made.items()}
    want = expected(layer, rounded, x.float(), y.float(), slots)

    def run():
        batch.set(np.array(slots, np.int32), np.arange(5, dtype=np.int32))
        return layer.apply(x, y.clone()).float()
    for got in both_paths(run):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=0.5)


@pytest.mark.parametrize("lens", [(1, 1, 1, 1), (3, 2, 4, 5), (1, 20, 1, 1)])
def test_bf16_tables_under_fp32_activations(lens, both_paths):
    """lora_dtype="bfloat16" with an fp32 model: the kernel and torch's runs both take the rounded tables (A, and
    B with its scale folded in) with fp32 sums, y written once."""
    gen = torch.Generator().manual_seed(3)
    base = QKVParallelLinear(64, 16, 4, 2)
    batch = LoRABatch(kernel=True)
    layer = LoRALayer(base, (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")), batch, SLOTS, RANK,
                      torch.bfloat16)
    made = adapters(layer, gen)
    assert layer.A.dtype == layer.B.dtype == torch.bfloat16
    rounded = {s: {p: (a.bfloat16().float(), (b * 0.5).bfloat16().float() / 0.5) for p, (a, b) in parts.items()}
               for s, parts in made.items()}
    slots = [2, 0, -1, 1]
    cu = np.cumsum([0, *lens]).astype(np.int32)
    x = torch.randn(int(cu[-1]), 64, generator=gen)
    y = torch.randn(int(cu[-1]), base.weight.shape[0], generator=gen)
    want = expected(layer, rounded, x, y, [s for s, n in zip(slots, lens) for _ in range(n)])

    def run():
        batch.set(np.array(slots, np.int32), cu)
        return layer.apply(x, y.clone())
    for got in both_paths(run):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
