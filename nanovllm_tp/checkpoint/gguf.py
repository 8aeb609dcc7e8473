"""GGUF checkpoints (llama.cpp's single-file format): find the file, read its header, build the HF config
and tokenizer from it, and hand its tensors to the loader under their HF names: dequantized, or, for the types
layers/quant.py runs (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) when the engine keeps them, as the file's
blocks (`QuantBlocks`).

The parts: gguf_header.py (the header, read without the gguf package), gguf_config.py (the HF config and
tokenizer), gguf_weights.py (tensors under HF names, read lazily). This file decides what stays quantized on a rank
and refuses a TP size that would split a block; it is the one place the engine imports them from.
"""
import torch

from nanovllm_tp.checkpoint.gguf_config import SUPPORTED, hf_config, load_tokenizer
from nanovllm_tp.checkpoint.gguf_header import GGUFHeader, TensorEntry, find_gguf, read_header, require_gguf
from nanovllm_tp.checkpoint.gguf_weights import GGUFWeight, iter_weights
from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.quant import BLOCK_SIZE, GGUF_TYPES

__all__ = ["SUPPORTED", "hf_config", "load_tokenizer", "GGUFHeader", "TensorEntry", "find_gguf", "read_header",
           "GGUFWeight", "iter_weights", "quantized_types", "keep_gguf_blocks", "check_block_split"]


def quantized_types(path: str) -> tuple[set[str], set[str]]:
    """The names of the block-quantized types of the file's 2-D tensors: (those layers/quant.py runs, the
    others)."""
    gguf = require_gguf()
    kinds = {t.ggml_type for t in read_header(path).tensors if len(t.shape) == 2}
    names = {k: gguf.GGMLQuantizationType(k).name for k in kinds}
    plain = {"F32", "F16", "BF16", "F64"}
    return ({names[k] for k in kinds if k in GGUF_TYPES},
            {names[k] for k in kinds if k not in GGUF_TYPES and names[k] not in plain})


def keep_gguf_blocks(config, device: torch.device) -> tuple[bool, str | None]:
    """Whether this rank loads the GGUF tensors of the types layers/quant.py runs as blocks (quantization "auto"
    on CPU, where the C kernels run them or, with cpu_kernels off, the torch reference), and what to log."""
    gguf = find_gguf(config.model) if config.quantization == "auto" else None
    if gguf is None:
        return False, None
    runs, others = quantized_types(gguf)
    other = f"; {'+'.join(sorted(others))} tensors dequantized (no kernels for them yet)" if others else ""
    if not runs:
        return False, f"GGUF weights dequantized at load{other}" if others else None
    kernels = cpu_kernels.load() if config.cpu_kernels else None
    why = (f"no quantized kernels on {device.type}" if device.type != "cpu"
           else None if not config.cpu_kernels
           else "the CPU kernels did not build" if kernels is None
           else None if kernels.quant_types else "this CPU has no AVX-512 VNNI")
    kinds = "+".join(sorted(runs))
    if why:
        return False, f"GGUF {kinds} weights dequantized at load: {why}{other}"
    how = "csrc/linear_q.c" if config.cpu_kernels else "the torch reference (cpu_kernels off)"
    return True, f"GGUF {kinds} weights stay quantized, run by {how}{other}"


def check_block_split(path: str, tp: int) -> None:
    """Row-parallel weights (attention output, MLP down) split their inputs across the ranks: refuse a TP size
    that would split a block of a tensor that stays quantized, naming it."""
    for t in read_header(path).tensors:
        if t.ggml_type in GGUF_TYPES and (".attn_output." in t.name or ".ffn_down." in t.name):
            if t.shape[-1] % (tp * BLOCK_SIZE[t.ggml_type]):
                raise ValueError(f"tensor_parallel_size={tp} would split the blocks of {BLOCK_SIZE[t.ggml_type]} of "
                                 f"{t.name} ({GGUF_TYPES[t.ggml_type]}, {t.shape[-1]} inputs: "
                                 f"{t.shape[-1] / tp:g} per rank); "
                                 "choose a TP size that keeps them whole, or quantization='none' (dequantized)")
