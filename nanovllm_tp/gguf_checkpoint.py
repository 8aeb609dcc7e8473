"""GGUF checkpoints (llama.cpp's single-file format): find the file, read its header, build the HF config
and tokenizer from it, and hand its tensors to the loader under their HF names: dequantized, or, for the types
layers/quant.py runs (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) when the engine keeps them, as the file's
blocks (`QuantBlocks`).

The header is read here (string arrays such as the vocabulary are stepped over, not decoded), so a rank pays
milliseconds for it; the `gguf` package dequantizes and maps GGUF tensor names to HF ones, transformers' GGUF
tables map metadata keys to config fields and its tensor processors undo the row permutation llama.cpp applies
to Llama's q/k projections (kept blocks: whole rows move). A quantized tensor is dequantized only for the rows a
rank keeps, unless permuted.
"""
import functools
import glob
import math
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.quant import BLOCK_SIZE, GGUF_TYPES, QuantBlocks

# GGUF architectures the engine reads (a qwen3moe file stacks each layer's experts: split at load)
SUPPORTED = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3moe")
# GGUF architecture -> transformers' model_type, where they differ
_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}
# a stacked expert tensor of a layer -> the name the model splits per expert (Qwen3MoeForCausalLM.checkpoint_parts)
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# the layer count of the Gemma model whose attention scale llama.cpp takes as hidden / heads (27B)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# metadata keys transformers' GGUF tables leave out that change the math: {arch}.KEY -> config field
_EXTRA_FIELDS = {"attention.sliding_window": "sliding_window", "attn_logit_softcapping": "attn_logit_softcapping",
                 "final_logit_softcapping": "final_logit_softcapping",
                 "expert_feed_forward_length": "moe_intermediate_size"}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def find_gguf(model: str) -> str | None:
    """The .gguf file `model` names: the path itself, or the one .gguf in a directory without config.json."""
    if os.path.isfile(model) and model.endswith(".gguf"):
        return os.path.abspath(model)
    if not os.path.isdir(model) or os.path.isfile(os.path.join(model, "config.json")):
        return None
    found = sorted(glob.glob(os.path.join(model, "*.gguf")))
    if len(found) > 1:
        raise ValueError(f"{model!r} holds several .gguf files ({', '.join(map(os.path.basename, found))}); "
                         "pass the one to load")
    return os.path.abspath(found[0]) if found else None


def _require_gguf():
    try:
        import gguf
    except ImportError:
        raise ValueError("reading a .gguf file needs the gguf package: pip install gguf") from None
    return gguf


@dataclass(slots=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]     # torch order (GGUF lists the innermost dimension first)
    ggml_type: int
    start: int                 # byte offset in the file


@dataclass(slots=True)
class GGUFHeader:
    path: str
    metadata: dict             # string arrays (vocabulary, merges) are kept as their length only
    tensors: list[TensorEntry]

    @property
    def arch(self) -> str:
        return self.metadata["general.architecture"]


class _Cursor:
    def __init__(self, blob):
        self.blob, self.pos = blob, 0

    def unpack(self, fmt: str):
        values = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += struct.calcsize(fmt)
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        self.pos += n
        return bytes(self.blob[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF metadata value type {kind}")
        item_kind, count = self.unpack("<I"), self.unpack("<Q")
        if item_kind in _SCALARS:
            fmt = _SCALARS[item_kind]
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.blob, self.pos))
            self.pos += count * struct.calcsize(fmt)
            return values
        for _ in range(count):      # strings or nested arrays: step over them, keep the count
            self.value(item_kind)
        return count


@functools.lru_cache(maxsize=4)
def read_header(path: str) -> GGUFHeader:
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(blob)
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    cur.pos = 4
    version, n_tensors, n_kv = cur.unpack("<IQQ")
    if version not in (2, 3):
        raise ValueError(f"{path} is GGUF version {version}; versions 2 and 3 are read")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    entries = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = cur.unpack(f"<{cur.unpack('<I')}Q")
        dims = (dims,) if isinstance(dims, int) else dims
        ggml_type, offset = cur.unpack("<IQ")
        entries.append((name, tuple(reversed(dims)), ggml_type, offset))
    align = metadata.get("general.alignment", 32)
    data_start = -(-cur.pos // align) * align
    tensors = [TensorEntry(n, s, t, data_start + o) for n, s, t, o in entries]
    return GGUFHeader(path, metadata, tensors)


@functools.lru_cache(maxsize=4)
def hf_config(path: str):
    """The transformers config the file describes (transformers' GGUF key -> config field tables)."""
    from transformers import AutoConfig
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    header = read_header(path)
    arch, meta = header.arch, header.metadata
    if arch not in SUPPORTED:
        raise ValueError(f"GGUF architecture {arch!r} in {path} is not supported (supported: {', '.join(SUPPORTED)})")
    if meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", "linear"):
        key = f"{arch}.rope.scaling.type"
        raise ValueError(f"{key}={meta[key]!r} in {path} is not implemented for GGUF files")
    if any(t.name == "rope_freqs.weight" for t in header.tensors):
        raise ValueError(f"{path} stores rope scaling as a rope_freqs tensor, which is not implemented")
    if any(t.name.startswith("rope_factors_") for t in header.tensors):
        raise ValueError(f"{path} stores LongRoPE factors (rope_factors_long/short tensors): longrope is not "
                         "implemented")
    hf_arch = "qwen3_moe" if arch == "qwen3moe" else arch       # the name of its transformers tables
    fields = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(hf_arch, {}))
    for key, value in meta.items():
        prefix, _, rest = key.partition(".")
        table = GGUF_CONFIG_MAPPING.get(hf_arch if prefix == arch else prefix if prefix in ("general", "tokenizer")
                                        else None, {})
        if table.get(rest) not in (None, -1):
            fields[table[rest]] = value
    if f"{arch}.attention.key_length" in meta:
        fields["head_dim"] = meta[f"{arch}.attention.key_length"]
    for key, field in _EXTRA_FIELDS.items():
        if meta.get(f"{arch}.{key}"):
            fields[field] = meta[f"{arch}.{key}"]
    if meta.get(f"{arch}.rope.scaling.type") == "linear":    # Gemma 3: its global layers only, as llama.cpp
        fields["rope_scaling"] = {"rope_type": "linear", "factor": meta[f"{arch}.rope.scaling.factor"]}
    if arch in _GEMMA_27B_LAYERS:
        fields["query_pre_attn_scalar"] = _gemma_query_scalar(arch, meta, fields)
    elif f"{arch}.attention.scale" in meta:
        raise ValueError(f"{arch}.attention.scale in {path} is not implemented for GGUF files of {arch}")
    head_dim = fields.get("head_dim") or fields.get("hidden_size", 0) // fields.get("num_attention_heads", 1)
    rotary = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:          # llama.cpp writes the rotated features of a head (Phi-4-mini: 3/4 of them)
        fields["partial_rotary_factor"] = rotary / head_dim
    fields.pop("_model_name_or_path", None)
    fields.setdefault("vocab_size", meta.get("tokenizer.ggml.tokens"))
    fields.setdefault("pad_token_id", None)     # not a class default past the file's vocabulary (Phi-3's 32000)
    fields["tie_word_embeddings"] = all(t.name != "output.weight" for t in header.tensors)
    model_type = _MODEL_TYPES.get(fields["model_type"], fields["model_type"])
    del fields["model_type"]
    return AutoConfig.for_model(model_type, **fields)


def _gemma_query_scalar(arch: str, meta: dict, fields: dict) -> float:
    """Gemma's attention scale as llama.cpp reads the file: attention.scale where written, else hidden / heads
    for the 27B model and head_dim for the others (HF's query_pre_attn_scalar of each)."""
    if f"{arch}.attention.scale" in meta:
        return meta[f"{arch}.attention.scale"] ** -2
    if fields["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]:
        return fields["hidden_size"] / fields["num_attention_heads"]
    return fields.get("head_dim") or fields["hidden_size"] / fields["num_attention_heads"]


def load_tokenizer(path: str):
    """A fast tokenizer built by transformers from the file's vocabulary, merges, special tokens and chat
    template."""
    from transformers import PreTrainedTokenizerFast
    _require_gguf()
    return PreTrainedTokenizerFast.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


class GGUFWeight:
    """One tensor of the file, read lazily like a safetensors slice: get_shape() and [rows] / [:, cols], as a
    tensor, or as QuantBlocks when `keep_blocks` and its type is one layers/quant.py runs."""

    def __init__(self, entry: TensorEntry, blob: np.ndarray, processor, permuted: bool, keep_blocks: bool = False):
        block, block_bytes = _require_gguf().GGML_QUANT_SIZES[entry.ggml_type]
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
        weights = _require_gguf().dequantize(data, self.entry.ggml_type).reshape(-1, *self.shape[1:])
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


def quantized_types(path: str) -> tuple[set[str], set[str]]:
    """The names of the block-quantized types of the file's 2-D tensors: (those layers/quant.py runs, the
    others)."""
    gguf = _require_gguf()
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


def iter_weights(path: str, keep_blocks: bool = False):
    """(HF tensor name, GGUFWeight) for every tensor of the file; keep_blocks: the types layers/quant.py runs come
    as the file's blocks."""
    gguf = _require_gguf()
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
