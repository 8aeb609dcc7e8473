"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) and the 5-bit types beside them in llama.cpp's files (Q5_0, Q5_1), kept
quantized (layers/quant_kblocks.py, csrc/linear_q.c). References: the gguf package's dequantizers for the
unpacked blocks (bit for bit); a float64 computation of the rounded math for the kernel; transformers reading the
same tiny GGUF (through the gguf package) with every linear input rounded as the kernel rounds it, for the
engine's greedy tokens at TP 1 and 2; and, for a CPU without AVX-512 VNNI (the kernels built without it), the
engine dequantizing at load with its log line."""
import copy
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanovllm_tp.launch.k_quants import scales_mins
from nanovllm_tp.layers import cpu_kernels, quant_kblocks
from nanovllm_tp.layers.packed_linear import matmul
from nanovllm_tp.layers.quant import (MixedBlocks, QuantBlocks, QuantParts, QuantWeight, pack_blocks, quant_embedding,
                                      round_activations, same_type, type_name, write_rows)
from tests.kquant_blocks import random_blocks
from tests.quant_reference import assert_follows_reference, rounded_reference

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")
KERNEL_TYPES = cpu_kernels.load().quant_types if cpu_kernels.load() else ()
needs_kernels = pytest.mark.skipif(14 not in KERNEL_TYPES, reason="csrc/linear_q.c needs AVX-512 VNNI")
TYPES = ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
MINS = ("Q5_1", "Q4_K", "Q5_K")       # w = d * q + m


def blocks_of(rows: int, k: int, name: str, seed: int) -> QuantBlocks:
    return QuantBlocks(torch.from_numpy(random_blocks(rows, k, name, seed)), int(gguf.GGMLQuantizationType[name]), k)


def unpacked_values(blocks: QuantBlocks) -> tuple[np.ndarray, np.ndarray]:
    """(the weights the unpacked blocks say, in fp32; |d * (q - off)| + |m| per weight, float64)."""
    name, (n, k) = gguf.GGMLQuantizationType(blocks.qtype).name, blocks.shape
    raw = quant_kblocks.unpack(blocks.data.numpy(), blocks.qtype).reshape(n, k // 32, -1)
    head = raw[..., :4].copy().view(np.float16).astype(np.float32)
    q = raw[..., -32:].astype(np.float32)
    first, second = head[..., :1], head[..., 1:2]
    if name in quant_kblocks.SUPER.values():          # the super-block's d and dmin times the block's integers
        ints = raw[..., 4:6].view(np.int8 if name == "Q6_K" else np.uint8).astype(np.float32)
        first, second = first * ints[..., :1], first * ints[..., 1:] if name == "Q6_K" else -(second * ints[..., 1:])
    if name == "Q6_K":
        scaled = (q - 32) * np.concatenate([np.repeat(first, 16, -1), np.repeat(second, 16, -1)], -1)
        return scaled.reshape(n, k), np.abs(scaled).reshape(n, k).astype(np.float64)
    scaled = (q - 16) * first if name == "Q5_0" else q * first
    values = scaled + second if name in MINS else scaled
    return values.reshape(n, k), (np.abs(scaled) + np.abs(second) * (name in MINS)).reshape(n, k).astype(np.float64)


@pytest.mark.parametrize("name", TYPES)
def test_unpacked_blocks_are_the_files_values_to_the_bit(name):
    blocks = blocks_of(9, 512, name, seed=4)
    values, _ = unpacked_values(blocks)
    assert np.array_equal(values, gguf.quants.dequantize(blocks.data.numpy(), blocks.qtype).reshape(9, 512))


@pytest.mark.parametrize("name", ["Q4_0", "Q5_0"])
def test_q4_0_and_q5_0_beside_q8_0_become_q8_0_without_loss(name):
    small, q8 = blocks_of(5, 64, name, seed=1), blocks_of(3, 64, "Q8_0", seed=2)
    a, b = same_type(small, q8)
    assert (a.qtype, b.qtype) == (8, 8) and b is q8
    assert torch.equal(a.dequantize(), small.dequantize())
    k4, q6 = blocks_of(2, 256, "Q4_K", seed=3), blocks_of(2, 256, "Q6_K", seed=3)
    assert same_type(k4, q6) == (k4, q6)         # no lossless common type: the merged layer keeps two parts


@needs_kernels
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("n, k", [(1, 256), (50, 512), (600, 1536)])
def test_kernel_is_the_rounded_math_summed_in_fp32(name, rows, n, k):
    """Every output is the float64 product of the rounded activations and the file's weights (+ bias) up to fp32
    sums over the blocks (each term bounded by |d * q| + |m|), rounded once to the dtype; the embedding's row
    gather is the file's rows."""
    blocks = blocks_of(n, k, name, seed=rows * 1000 + n)
    packed = pack_blocks(blocks)
    assert isinstance(packed, QuantWeight) and (packed.out_features, packed.in_features) == (n, k)
    w = torch.from_numpy(gguf.quants.dequantize(blocks.data.numpy(), blocks.qtype).reshape(n, k)).double()
    size = torch.from_numpy(unpacked_values(blocks)[1])
    g = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=g)
    x[:, ::37] *= 50.0
    bias = torch.randn(n, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        rounded = round_activations(x.to(dtype)).double()
        want = F.linear(rounded, w, bias.to(dtype).double())
        bound = (rounded.abs() @ size.T) * (k // 32 + 4) * 2.0 ** -24
        if dtype is torch.bfloat16:
            bound += want.abs() * 2.0 ** -8
        got = matmul(x.to(dtype), torch.empty(0, k), packed, bias.to(dtype))
        assert got.dtype is dtype and ((got.double() - want).abs() <= bound).all()
    ids = torch.tensor([0, n - 1, n // 2])
    rows_got = quant_embedding(ids, packed, torch.float32).double()
    assert ((rows_got - w[ids]).abs() <= size[ids] * 2.0 ** -23).all()


@needs_kernels
@pytest.mark.parametrize("name, bits", [("Q4_K", 4.625), ("Q5_K", 5.625), ("Q6_K", 6.5625), ("Q5_0", 5.5),
                                        ("Q5_1", 6.0)])
def test_k_quants_are_packed_compact(name, bits):
    """csrc/linear_q.c keeps a K-quant's fp16 d (and dmin) per super-block of 256 and its sub-block integers (one
    byte each) per block of 32 beside the quants, a nibble each plus the 5-bit types' fifth bit and Q6_K's two
    high bits in planes of their own: the file's bits per weight (Q5_0 5.5, Q5_1 6) but for the K-quants' sub-block
    scales and mins unpacked to bytes (Q4_K 4.625 against 4.5, Q5_K 5.625 against 5.5, Q6_K 6.5625 as the file,
    whose scales are bytes already), not 6 / 8.625 / 8.5625 (fp32 scales, a byte per quant); the K-quants whole
    super-blocks only."""
    n, k = 50, 512
    blocks = blocks_of(n, k, name, seed=7)
    padded = -(-n // 32) * 32 * k
    assert pack_blocks(blocks).data.numel() * 8 == padded * bits
    assert cpu_kernels.load()._q_packed_bytes(n, k, blocks.qtype) * 8 == padded * bits
    assert (cpu_kernels.load()._q_packed_bytes(n, 288, blocks.qtype) == -1) == name.endswith("_K")


@needs_kernels
def test_q4_k_extreme_scales_and_mins_are_the_files_values():
    """Q4_K with sub-block scales and mins of 0 and 63 and super-block d and dmin from an fp16 subnormal to near
    fp16's largest, either sign: the kernel's gathered rows are the file's weights to the bit, and its outputs
    (one row, and chunks of rows, fp32 and bf16) the torch reference's up to fp32 sums in another order."""
    n, k = 40, 2048
    blocks = blocks_of(n, k, "Q4_K", seed=11)
    raw = blocks.data.numpy().reshape(-1, 144)
    nbl = raw.shape[0]
    rng = np.random.default_rng(11)
    sc, mn = rng.choice(np.array([0, 63], np.uint8), (2, nbl, 8))
    sc[0], mn[0], sc[1], mn[1] = 0, 0, 63, 63
    raw[:, 4:16] = scales_mins(sc, mn)
    magnitudes = np.array([6e-8, 3e-5, 1e-3, 0.25, 1.0, 37.0, 1000.0, 60000.0], np.float32)
    for at in (0, 2):
        d = magnitudes[rng.integers(0, len(magnitudes), nbl)] * rng.choice([-1.0, 1.0], nbl).astype(np.float32)
        raw[:, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(nbl, 2)
    file = torch.from_numpy(gguf.quants.dequantize(blocks.data.numpy(), blocks.qtype).reshape(n, k))
    assert torch.isfinite(file).all() and (file == 0).any() and file.abs().max() > 1e6
    packed = pack_blocks(blocks)
    assert torch.equal(quant_embedding(torch.arange(n), packed, torch.float32), file)
    with cpu_kernels.switched(False):
        reference = pack_blocks(blocks)
    size = torch.from_numpy(unpacked_values(blocks)[1])
    g = torch.Generator().manual_seed(3)
    for rows in (1, 5):
        x = torch.randn(rows, k, generator=g)
        x[:, ::37] *= 50.0
        for dtype in (torch.float32, torch.bfloat16):
            want = matmul(x.to(dtype), torch.empty(0, k), reference, None).double()
            bound = (round_activations(x.to(dtype)).double().abs() @ size.T) * (k // 32 + 4) * 2.0 ** -23
            if dtype is torch.bfloat16:
                bound += want.abs() * 2.0 ** -7
            got = matmul(x.to(dtype), torch.empty(0, k), packed, None).double()
            assert ((got - want).abs() <= bound).all()


@pytest.mark.parametrize("kernels", [True, False])
def test_parts_of_two_types_run_side_by_side(kernels):
    """A merged weight of Q4_K rows beside Q6_K rows (MixedBlocks): its outputs, bias included, are each part's
    own, through the kernels and through the torch reference."""
    if kernels and 14 not in KERNEL_TYPES:
        pytest.skip("csrc/linear_q.c needs AVX-512 VNNI")
    a, b = blocks_of(40, 256, "Q4_K", seed=5), blocks_of(24, 256, "Q6_K", seed=6)
    merged = write_rows(write_rows(QuantBlocks.zeros(64, 256, a.qtype), 0, a), 40, b)
    assert isinstance(merged, MixedBlocks) and torch.equal(merged.dequantize(), torch.cat([a.dequantize(),
                                                                                           b.dequantize()]))
    x, bias = torch.randn(3, 256), torch.randn(64)
    with cpu_kernels.switched(kernels):
        packed, parts = pack_blocks(merged), (pack_blocks(a), pack_blocks(b))
    assert isinstance(packed, QuantParts) and type_name(packed) == "Q4_K+Q6_K"
    want = torch.cat([matmul(x, torch.empty(0, 256), parts[0], bias[:40]),
                      matmul(x, torch.empty(0, 256), parts[1], bias[40:])], dim=-1)
    assert torch.equal(matmul(x, torch.empty(0, 256), packed, bias), want)


# ---------------------------------------------------------------- engine on tiny GGUFs

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
MIXES = {   # llama.cpp's mixes at the tiny shape: Q4_K_M's (and its fallbacks), and one of every K type
    "q4_k_m": dict(qtype="Q4_K", layer_qtypes={"q_proj": "Q5_0", "k_proj": "Q5_0", "v_proj": "Q8_0",
                                               "down_proj": "Q6_K", "up_proj": "Q5_1", "gate_proj": "Q5_1"}),
    "k": dict(qtype="Q4_K", layer_qtypes={"down_proj": "Q5_K", "o_proj": "Q5_K", "v_proj": "Q6_K"}),
}
RUNS = {"q4_k_m": "Q4_K+Q5_1+Q6_K+Q8_0", "k": "Q4_K+Q5_K+Q6_K+Q8_0"}


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory, tiny_model_dir):
    """mix -> (a tiny llama GGUF of that mix, transformers loading it with rounded linear inputs)."""
    from transformers import AutoModelForCausalLM
    from nanovllm_tp.launch.make_tiny import make_tiny_arch
    from tests.gguf_tiny import write_gguf
    made = {}

    def get(mix: str, **shape):
        key = (mix, tuple(sorted(shape.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"gguf-{mix}")
            hf = make_tiny_arch(out / "hf", "llama", **{**SHAPE, **shape})
            path = write_gguf(hf, pathlib.Path(tiny_model_dir), out / "tiny.gguf", arch="llama", **MIXES[mix])
            ref = AutoModelForCausalLM.from_pretrained(str(out), gguf_file="tiny.gguf", dtype=torch.float32).eval()
            made[key] = path, ref
        return made[key]
    return get


TP2 = (pytest.mark.spawn, pytest.mark.slow)


@pytest.mark.parametrize("mix, tp, kernels", [
    ("q4_k_m", 1, True), ("k", 1, True), ("k", 1, False),
    pytest.param("q4_k_m", 2, True, marks=TP2), pytest.param("k", 2, True, marks=TP2),
    pytest.param("k", 2, False, marks=TP2)])
def test_greedy_tokens_are_the_rounded_math(mix, tp, kernels, kquant_gguf):
    """The engine against transformers with every linear input rounded per block of 32 (tests/quant_reference.py
    says what is compared: tokens up to the first near tie, teacher-forced logprobs everywhere; at this width a
    chunked prefill's attention sums, a few ulps off transformers', can move a rounding step, so even the torch
    reference is held to the near-tie rule). Q4_K_M's q and k (Q5_0) beside v (Q8_0)
    run as one Q8_0 weight; q and k in Q4_K beside v in Q6_K (the only Q6_K of that mix) as two."""
    if kernels and 14 not in KERNEL_TYPES:
        pytest.skip("csrc/linear_q.c needs AVX-512 VNNI")
    path, ref = kquant_gguf(mix)
    stats = assert_follows_reference(str(path), rounded_reference(copy.deepcopy(ref)), tensor_parallel_size=tp,
                                     cpu_kernels=kernels)
    assert stats["quantization"] == RUNS[mix]
    assert stats["linear"] == "+".join(t.lower() + ("" if kernels else "-torch") for t in RUNS[mix].split("+"))



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_merged_layer_of_two_types_runs_in_the_fused_decode_layers(dtype, kquant_gguf):
    """Q4_K_M's merged q/k/v of two types (q, k Q4_K beside v Q6_K: QuantParts) runs between the fused decode
    layers' C calls, part by part through the modules' quant_matmul, instead of sending every decode step to the
    modules: decode steps run fused, with the modules' tokens and logprobs to the bit."""
    if 14 not in KERNEL_TYPES:
        pytest.skip("csrc/linear_q.c needs AVX-512 VNNI")
    from nanovllm_tp import LLM, SamplingParams
    path, _ = kquant_gguf("k")
    prompts = [[5, 6, 7, 8], list(range(20, 45)), [9] * 3]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    results = {}
    for on in (True, False):
        with LLM(str(path), fused_decode=on, dtype=dtype, kvcache_block_size=16, kv_cache_memory=16 << 20) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            fused = llm.engine.runner.model.model.fused
            assert llm.stats()["quantization"] == RUNS["k"]
            if on:
                assert fused.steps >= 7 and fused.caller_steps == fused.steps
            else:
                assert fused is None
        results[on] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert results[True] == results[False]


def test_a_tp_size_that_splits_a_super_block_is_refused(kquant_gguf):
    from nanovllm_tp.config.engine_config import EngineConfig
    path, _ = kquant_gguf("k", intermediate_size=256)        # ffn_down Q5_K: 128 inputs per rank
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 would split the blocks of 256 of "
                                         r"blk.0.ffn_down.weight \(Q5_K, 256 inputs: 128 per rank\)"):
        EngineConfig.from_kwargs(str(path), tensor_parallel_size=2, device="cpu").validate()
    EngineConfig.from_kwargs(str(path), tensor_parallel_size=2, device="cpu", quantization="none").validate()


FALLBACK = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from nanovllm_tp import LLM, SamplingParams
llm = LLM(sys.argv[1], kv_cache_memory=16 << 20, kvcache_block_size=16)
try:
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"stats": llm.stats(), "tokens": out[0].outputs[0].token_ids}))
finally:
    llm.close()
"""


@pytest.mark.spawn
def test_without_vnni_the_weights_are_dequantized_with_a_log_line(kquant_gguf, tmp_path):
    """The kernels compiled for a CPU without AVX-512 VNNI (a compiler wrapper adds -mno-avx512vnni): the K-quant
    file loads dequantized, says so once, and its greedy tokens are transformers' on the dequantized weights."""
    from tests.helpers import hf_greedy
    path, ref = kquant_gguf("k")
    wrapper = tmp_path / "cc-no-vnni"
    wrapper.write_text('#!/bin/sh\nexec cc "$@" -mno-avx512vnni\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "CC": str(wrapper), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", FALLBACK, str(path)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=pathlib.Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "weights dequantized at load: this CPU has no AVX-512 VNNI" in done.stderr
    assert result["stats"]["quantization"] == "none"
    assert result["tokens"] == hf_greedy(ref, [5, 6, 7, 8], 6)


@needs_kernels
@pytest.mark.spawn
def test_without_gfni_the_high_bits_are_put_back_by_shifts_and_masks(tmp_path):
    """The kernels compiled for a CPU without GFNI (a compiler wrapper adds -mno-gfni: AVX-512 VNNI CPUs before
    Ice Lake) put the 5-bit types' fifth bit and Q6_K's two high bits back above the nibble with 16-bit shifts and
    masks instead of the affine transform: the same kernel checks pass (the rounded math summed in fp32, for every
    type with high bits, rows 1 / 5 / 33, three shapes)."""
    calls = tmp_path / "cc-calls"
    wrapper = tmp_path / "cc-no-gfni"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec cc "$@" -mno-gfni\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "CC": str(wrapper), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{__file__}::test_kernel_is_the_rounded_math_summed_in_fp32", "-k", "Q5 or Q6"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=pathlib.Path(__file__).parents[2])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "36 passed" in done.stdout
    assert "linear_q.c" in calls.read_text()          # the kernels were built here, by the wrapper
