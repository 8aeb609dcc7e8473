"""A GGUF file's tensors under their HF names (the gguf package's tensor-name map against the HF model's
parameters; a layer's stacked experts under one name the model splits), each read lazily like a safetensors
slice: dequantized for the rows a rank keeps (whole where llama.cpp permuted Llama's q/k rows: transformers'
tensor processors undo that), or, for the types layers/quant.py runs, as the file's blocks (`QuantBlocks`; a
permuted tensor's whole rows move)."""
import math

import numpy as np
import torch

from nanovllm_tp.checkpoint.gguf_config import hf_config
from nanovllm_tp.checkpoint.gguf_header import TensorEntry, read_header, require_gguf
from nanovllm_tp.layers.quant import GGUF_TYPES, QuantBlocks

# a stacked expert tensor of a layer -> the name the model splits per expert (Qwen3MoeForCausalLM.checkpoint_parts)
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


class GGUFWeight:
    """One tensor of the file, read lazily like a safetensors slice: get_shape() and [rows] / [:, cols], as a
    tensor, or as QuantBlocks when `keep_blocks` and its type is one layers/quant.py runs."""

    def __init__(self, entry: TensorEntry, blob: np.ndarray, processor, permuted: bool, keep_blocks: bool = False):
        block, block_bytes = require_gguf().GGML_QUANT_SIZES[entry.ggml_type]
        rows = math.prod(entry.shape[:-1])
        # a stacked 3-D tensor (a layer's experts) reads as its rows: [experts * rows, columns]
        self.shape = entry.shape if len(entry.shape) < 3 else (rows, entry.shape[-1])
        row_bytes = entry.shape[-1] // block * block_bytes
        self.data = blob[entry.start:entry.start + rows * row_bytes].reshape(rows, row_bytes)
        self.entry, self.processor, self.permuted = entry, processor, permuted
        # 1-D tensors go through the architecture's processor whole (Gemma's norms are stored as 1 + weight)
        self.processed = len(entry.shape) == 1 and type(processor).__name__ != "TensorProcessor"
        self.keep_blocks = keep_blocks and entry.ggml_type in GGUF_TYPES and len(entry.shape) == 2

    def get_shape(self) -> tuple[int, ...]:
        return self.shape

    def _dequantize(self, data) -> np.ndarray:
        weights = require_gguf().dequantize(data, self.entry.ggml_type).reshape(-1, *self.shape[1:])
        return weights if weights.flags.writeable else weights.copy()     # unquantized data is the read-only map

    def _blocks(self, key) -> QuantBlocks:
        rows, cols = (key, slice(None)) if isinstance(key, slice) else key
        if self.permuted:      # llama.cpp's q/k row order, undone on the row indices
            n = self.entry.shape[0]
            order = self.processor.process(weights=np.arange(n).reshape(n, 1), name=self.entry.name).weights
            data = self.data[order.reshape(-1)[rows]]
        else:
            data = np.array(self.data[rows])
        blocks = QuantBlocks(torch.from_numpy(data), self.entry.ggml_type, self.entry.shape[1])
        if cols == slice(None):
            return blocks
        start, stop, _ = cols.indices(self.entry.shape[1])
        return blocks.columns(start, stop - start, self.entry.name)

    def __getitem__(self, key):
        if self.keep_blocks:
            return self._blocks(key)
        if isinstance(key, slice) and not self.permuted and len(self.entry.shape) > 1:    # rows: just those
            return torch.from_numpy(self._dequantize(self.data[key]))
        weights = self._dequantize(self.data)
        if self.permuted or self.processed:
            weights = self.processor.process(weights=weights, name=self.entry.name).weights
        return torch.from_numpy(np.ascontiguousarray(weights[key]))


def iter_weights(path: str, keep_blocks: bool = False):
    """(HF tensor name, GGUFWeight) for every tensor of the file; keep_blocks: the types layers/quant.py runs come
    as the file's blocks."""
    gguf = require_gguf()
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor
    header, config = read_header(path), hf_config(path)
    with torch.device("meta"):     # only the HF parameter names matter
        hf_names = AutoModelForCausalLM.from_config(config).state_dict().keys()
    gguf_arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == header.arch)
    tensor_names = gguf.get_tensor_name_map(gguf_arch, config.num_hidden_layers)
    to_hf = {}
    for hf_name in hf_names:
        base, _, suffix = hf_name.rpartition(".")
        if (gguf_name := tensor_names.get_name(base)) is not None:
            to_hf[f"{gguf_name}.{suffix}"] = hf_name
    processor = TENSOR_PROCESSORS.get(header.arch, TensorProcessor)(config=config.to_dict())
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    for layer in range(config.num_hidden_layers):
        for gguf_name, ours in _EXPERTS.items():
            to_hf[f"blk.{layer}.{gguf_name}.weight"] = f"model.layers.{layer}.mlp.experts.{ours}.stacked"
    for entry in header.tensors:
        if entry.name not in to_hf:
            raise ValueError(f"GGUF tensor {entry.name!r} in {path} has no counterpart in the HF model")
        permuted = type(processor) is not TensorProcessor and (".attn_q." in entry.name or ".attn_k." in entry.name)
        yield to_hf[entry.name], GGUFWeight(entry, blob, processor, permuted, keep_blocks)
