"""Weights that stay block-quantized (layers/quant.py, csrc/linear_q.c). References: a float64 computation of the
same math (the gguf package's dequantized weights against activations rounded per block of 32 as
`round_activations` says) for the kernel, per type, shape, row count and dtype; transformers loading the same
tiny GGUF with every linear layer's input rounded that way for the engine's greedy tokens (TP 1 and 2, through the
C kernels and through the torch reference). Also the embedding's row gather, the refusals, and SmolLM2's Q4_1
file run quantized."""
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.packed_linear import matmul
from nanovllm_tp.layers.quant import (INT8, INT8_BLOCK, QuantBlocks, QuantReference, QuantWeight, act_block,
                                      int8_blocks, pack_blocks, quant_embedding, round_activations)
from tests.helpers import GGUF, smollm2
from tests.quant_reference import assert_follows_reference, rounded_reference

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")
KERNEL_TYPES = cpu_kernels.load().quant_types if cpu_kernels.load() else ()
needs_kernels = pytest.mark.skipif(not KERNEL_TYPES, reason="csrc/linear_q.c needs AVX-512 VNNI")
TYPES = ["Q8_0", "Q4_0", "Q4_1"]


def random_blocks(n: int, k: int, name: str, seed: int) -> QuantBlocks:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    if name == "Q4_1":
        w += 0.05       # blocks whose min is not -max
    if name == "int8":
        return int8_blocks(torch.from_numpy(w))
    kind = gguf.GGMLQuantizationType[name]
    return QuantBlocks(torch.from_numpy(gguf.quants.quantize(w, kind)), int(kind), k)


def magnitude(blocks: QuantBlocks) -> torch.Tensor:
    """|d * q| + |m| per weight (float64): what a weight's terms in the kernel's sums are bounded by."""
    w = blocks.dequantize().double()
    if blocks.qtype != 3:      # Q4_1
        return w.abs()
    n, k = blocks.shape
    mins = blocks.data.view(n, k // 32, 20)[:, :, 2:4].contiguous().view(torch.float16).double()
    mins = mins.expand(n, k // 32, 32).reshape(n, k)
    return (w - mins).abs() + mins.abs()


@needs_kernels
@pytest.mark.parametrize("name", TYPES + ["int8"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 33, 70])
@pytest.mark.parametrize("n, k", [(1, 32), (17, 64), (50, 96), (600, 576), (33, 1536)])
def test_kernel_is_the_rounded_math_summed_in_fp32(name, rows, n, k):
    """Every output is the float64 product of the rounded activations and the dequantized weights (+ bias) up to
    fp32 sums over the blocks, rounded once to the dtype: chunks of fewer rows than the kernel's, a last unit of
    fewer than 32 outputs, strided 3-d activations with outliers (blocks of very different scales). One thread
    gives the same outputs as two."""
    blocks = random_blocks(n, k, name, seed=rows * 1000 + n)
    packed = pack_blocks(blocks)
    assert isinstance(packed, QuantWeight) and (packed.out_features, packed.in_features) == (n, k)
    g = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, 3, k, generator=g)[:, 1]
    x[:, ::37] *= 50.0
    w, size = blocks.dequantize().double(), magnitude(blocks)
    bias = torch.randn(n, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        rounded = round_activations(xd, act_block(blocks.qtype)).double()     # int8: 128 per scale, a tail
        for b in (None, bias.to(dtype)):
            want = F.linear(rounded, w, None if b is None else b.double())
            bound = (rounded.abs() @ size.T) * (k // 32 + 4) * 2.0 ** -24
            if dtype is torch.bfloat16:
                bound += want.abs() * 2.0 ** -8
            got = matmul(xd.reshape(rows, 1, k), torch.empty(0, k), packed, b)
            assert got.dtype is dtype and got.shape == (rows, 1, n)
            assert ((got[:, 0].double() - want).abs() <= bound).all()
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                assert torch.equal(matmul(xd, torch.empty(0, k), packed, b), got[:, 0])
            finally:
                torch.set_num_threads(threads)


def identity(k: int, name: str) -> QuantBlocks:
    """The k x k identity as Q8_0 (d = 1, q = 1 on the diagonal) or int8 (scale 1)."""
    if name == "int8":
        raw = np.zeros((k, 4 + k), np.uint8)
        raw[:, :4] = np.frombuffer(np.float32(1.0).tobytes(), np.uint8)
        raw[np.arange(k), 4 + np.arange(k)] = 1
        return QuantBlocks(torch.from_numpy(raw), INT8, k)
    raw = np.zeros((k, k // 32, 34), np.uint8)
    raw[:, :, :2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    raw[np.arange(k), np.arange(k) // 32, 2 + np.arange(k) % 32] = 1
    return QuantBlocks(torch.from_numpy(raw.reshape(k, -1)), 8, k)


@needs_kernels
@pytest.mark.parametrize("name, k", [("Q8_0", 576), ("int8", 576), ("int8", 288), ("int8", 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rounds_activations_as_the_reference(name, k, dtype):
    """Through an identity weight each output is one rounded activation: the kernel's rounding is
    round_activations' to the bit, ties included (bf16 inputs land on them often), per block of 32 (Q8_0) or
    per block of 128 with a shorter last one (int8: 576 = 4 x 128 + 64, a TP rank's 288 = 2 x 128 + 32, 96)."""
    blocks = identity(k, name)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(5)).to(dtype)
    x[:, ::37] *= 50.0
    want = round_activations(x, act_block(blocks.qtype))
    assert torch.equal(matmul(x.float(), torch.empty(0, k), pack_blocks(blocks)), want)


def test_int8_weights_round_per_output_channel():
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.01, 2, 40)[:, None]
    blocks = int8_blocks(w.bfloat16())
    scale = w.bfloat16().float().abs().amax(1, keepdim=True) / 127
    assert blocks.qtype == INT8 and blocks.shape == (40, 96) and blocks.data.shape == (40, 4 + 96)
    assert ((blocks.dequantize() - w.bfloat16().float()).abs() <= scale * (0.5 + 1e-6)).all()
    torch.testing.assert_close(blocks.dequantize().abs().amax(1, keepdim=True), scale * 127, rtol=1e-6, atol=0)


def test_activations_round_per_block_of_32():
    x = torch.tensor([[127.0, 63.5, -0.5, 1.5] + [0.0] * 28 + [0.0] * 32])
    got = round_activations(x)
    # d = 1 for the first block: half-way values go to the even neighbour; an all-zero block stays zero
    assert got[0, :4].tolist() == [127.0, 64.0, -0.0, 2.0] and not got[0, 4:].any()
    assert round_activations(x.bfloat16()).dtype is torch.float32


def test_int8_activations_round_per_block_of_128_and_a_tail():
    """int8's blocks: 128 inputs share a scale (a large value coarsens its block only), and the last block of a
    row is what is left (here 32 inputs with a scale of their own)."""
    assert act_block(INT8) == INT8_BLOCK == 128 and act_block(8) == 32
    x = torch.full((1, 288), 1.0)
    x[0, 0] = 254.0          # block 0's scale: 2, so its ones (half-way) round to the even 0
    x[0, 128] = 127.0        # block 1's: 1, ones stay
    x[0, 256:] = 0.3         # the tail's own scale: 0.3 / 127
    got = round_activations(x, INT8_BLOCK)[0]
    assert got[0] == 254.0 and not got[1:128].any()
    assert got[128] == 127.0 and (got[129:256] == 1.0).all()
    torch.testing.assert_close(got[256:], torch.full((32,), 0.3), rtol=1e-6, atol=0)


@needs_kernels
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_are_the_dequantized_rows(name, dtype):
    blocks = random_blocks(70, 96, name, seed=1)
    ids = torch.tensor([[0, 69, 31], [32, 5, 5]])
    got = quant_embedding(ids, pack_blocks(blocks), dtype)
    want = blocks.dequantize()[ids]
    assert got.dtype is dtype and got.shape == (2, 3, 96)
    if name == "Q4_1":     # d * q + m may be one fused multiply-add in the kernel
        assert ((got.double() - want.double()).abs() <= magnitude(blocks)[ids] * 2.0 ** -8).all()
    else:
        assert torch.equal(got, want.to(dtype))
    with cpu_kernels.switched(False):
        reference = pack_blocks(blocks)
    assert isinstance(reference, QuantReference) and torch.equal(quant_embedding(ids, reference, dtype),
                                                                 want.to(dtype))


def test_parts_of_a_merged_weight_keep_their_types():
    """A merged layer (q, k, v) keeps its parts' blocks: one type as one weight; Q4_0 beside Q8_0 as Q8_0 (no
    loss); Q4_0 beside Q4_1 as runs of rows of each (parts written in any order); one part dense: dequantized
    whole."""
    from nanovllm_tp.layers.quant import MixedBlocks
    from nanovllm_tp.layers.weight_loading import load_rows
    a, b, c = (random_blocks(4, 64, "Q4_0", seed=0), random_blocks(2, 64, "Q8_0", seed=1),
               random_blocks(2, 64, "Q4_1", seed=2))
    same = torch.nn.Parameter(torch.empty(8, 64), requires_grad=False)
    load_rows(same, 0, a)
    load_rows(same, 4, a)
    assert same.blocks.qtype == a.qtype and torch.equal(same.blocks.data, torch.cat([a.data, a.data]))
    widened = torch.nn.Parameter(torch.empty(6, 64), requires_grad=False)
    load_rows(widened, 0, a)
    load_rows(widened, 4, b)
    assert widened.blocks.qtype == 8 and torch.equal(widened.blocks.dequantize(), torch.cat([a.dequantize(),
                                                                                             b.dequantize()]))
    mixed = torch.nn.Parameter(torch.empty(10, 64), requires_grad=False)
    for offset, part in ((8, c), (0, a), (4, a)):
        load_rows(mixed, offset, part)
    assert isinstance(mixed.blocks, MixedBlocks) and [p.qtype for p in mixed.blocks.parts] == [2, 3]
    assert torch.equal(mixed.blocks.dequantize(), torch.cat([a.dequantize(), a.dequantize(), c.dequantize()]))
    dense = torch.nn.Parameter(torch.empty(6, 64), requires_grad=False)
    load_rows(dense, 0, a)
    load_rows(dense, 4, b.dequantize())
    assert dense.blocks is None and torch.equal(dense.data, torch.cat([a.dequantize(), b.dequantize()]))
    dense_first = torch.nn.Parameter(torch.empty(6, 64), requires_grad=False)
    load_rows(dense_first, 4, b.dequantize())
    load_rows(dense_first, 0, a)
    assert dense_first.blocks is None and torch.equal(dense_first.data[:4], a.dequantize())


def test_a_slice_inside_a_block_is_refused():
    blocks = random_blocks(4, 96, "Q4_0", seed=0)
    assert blocks.columns(32, 64, "w").shape == (4, 64)
    with pytest.raises(ValueError, match=r"blk.0.ffn_down.weight: a slice of inputs 0..48 splits its blocks of 32"):
        blocks.columns(0, 48, "blk.0.ffn_down.weight")


# ---------------------------------------------------------------- engine on tiny GGUFs

@pytest.fixture(scope="module")
def quantized_ggufs(tmp_path_factory, tiny_model_dir):
    """(arch, qtype, tied, overrides) -> (a tiny GGUF, transformers loading it with rounded linear inputs)."""
    import pathlib
    from transformers import AutoModelForCausalLM
    from nanovllm_tp.launch.make_tiny import make_tiny_arch
    from tests.gguf_tiny import write_gguf
    made = {}

    def get(arch: str, qtype: str, tied: bool = False, **overrides):
        key = (arch, qtype, tied, tuple(sorted(overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"gguf-{arch}-{qtype}")
            hf = make_tiny_arch(out / "hf", arch, tie_word_embeddings=tied, **overrides)
            path = write_gguf(hf, pathlib.Path(tiny_model_dir), out / "tiny.gguf", arch=arch, qtype=qtype)
            ref = AutoModelForCausalLM.from_pretrained(str(out), gguf_file="tiny.gguf", dtype=torch.float32).eval()
            made[key] = path, rounded_reference(ref)
        return made[key]
    return get


TP2 = (pytest.mark.spawn, pytest.mark.slow)


@pytest.mark.parametrize("arch, qtype, tied, tp, kernels", [
    ("llama", "Q4_1", True, 1, True), pytest.param("llama", "Q4_1", True, 2, True, marks=TP2),
    pytest.param("llama", "Q4_0", False, 2, True, marks=TP2), ("qwen2", "Q8_0", False, 1, True),
    ("llama", "Q4_1", True, 1, False), pytest.param("llama", "Q4_0", False, 2, False, marks=TP2)])
def test_greedy_tokens_are_the_rounded_math(arch, qtype, tied, tp, kernels, quantized_ggufs):
    """The engine (kernels: csrc/linear_q.c; else the torch reference, cpu_kernels off) against transformers with
    every linear input rounded the same way (see tests/quant_reference.py for what is compared)."""
    if kernels and not KERNEL_TYPES:
        pytest.skip("csrc/linear_q.c needs AVX-512 VNNI")
    path, ref = quantized_ggufs(arch, qtype, tied)
    stats = assert_follows_reference(str(path), ref, exact=tp == 1 and not kernels, tensor_parallel_size=tp,
                                     cpu_kernels=kernels)
    types = sorted({qtype, "Q8_0"})
    assert stats["quantization"] == "+".join(types)
    assert stats["linear"] == "+".join(t.lower() + ("" if kernels else "-torch") for t in types)


def test_a_tp_size_that_splits_a_block_is_refused(quantized_ggufs):
    from nanovllm_tp.config.engine_config import EngineConfig
    path, _ = quantized_ggufs("llama", "Q4_0", intermediate_size=288)     # 144 inputs of ffn_down per rank
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 would split the blocks of 32 of "
                                         r"blk.0.ffn_down.weight \(Q4_0, 288 inputs: 144 per rank\)"):
        EngineConfig.from_kwargs(str(path), tensor_parallel_size=2, device="cpu").validate()
    EngineConfig.from_kwargs(str(path), tensor_parallel_size=2, device="cpu", quantization="none").validate()
    with pytest.raises(ValueError, match="quantization must be one of 'auto', 'none', 'int8', got 'q4'"):
        EngineConfig.from_kwargs(str(path), quantization="q4").validate()
    with pytest.raises(ValueError, match=r"quantization='int8' quantizes a bf16/fp32 checkpoint; .* is quantized "
                                         r"already \(Q4_0\+Q8_0\): use quantization='auto'"):
        EngineConfig.from_kwargs(str(path), quantization="int8", device="cpu").validate()


@smollm2
@needs_kernels
@pytest.mark.slow
def test_smollm2_runs_quantized_in_the_files_bytes():
    """SmolLM2's Q4_1 file: its linear layers stay Q4_1, its tied embedding and LM head Q8_0 (one packed copy), the
    weights take about the file's bytes, and greedy chat answers are sensible. (Not asked: the capital of France,
    whose first token is a near tie in the dequantized model, "The" 0.08 nats above "L"; with int8 activations
    this engine, like llama.cpp on the same file and prompt, starts "L'Étoile, la ...".)"""
    llm = LLM(GGUF, max_model_len=256, kv_cache_memory=32 << 20)
    try:
        stats = llm.stats()
        model = llm.engine.runner.model
        packed = {id(m.packed): m.packed.data.nbytes for m in model.modules()
                  if isinstance(getattr(m, "packed", None), QuantWeight)}
        held = sum(packed.values()) + sum(p.nbytes for p in model.parameters())
        outs = llm.chat([[{"role": "user", "content": q}] for q in ("What is the capital of Germany?",
                                                                    "What is 2 + 3?")],
                        SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    finally:
        llm.close()
    assert stats["quantization"] == "Q4_1+Q8_0" and stats["linear"] == "q4_1+q8_0"
    assert len(packed) == 30 * 4 + 1 and 0.9 < held / os.path.getsize(GGUF) < 1.01
    assert "Berlin" in outs[0].outputs[0].text and "5" in outs[1].outputs[0].text
