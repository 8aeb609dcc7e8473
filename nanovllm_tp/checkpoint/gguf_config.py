"""The transformers config and tokenizer a GGUF file describes: transformers' GGUF tables map metadata keys to
config fields; the metadata those tables leave out that changes the math is read here (sliding windows, logit
caps, Gemma's attention scale, linear rope scaling, partial rotary), and what is not implemented is refused by
name."""
import functools
import os

from nanovllm_tp.checkpoint.gguf_header import read_header, require_gguf

# GGUF architectures the engine reads (a qwen3moe file stacks each layer's experts: split at load)
SUPPORTED = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3moe")
# GGUF architecture -> transformers' model_type, where they differ
_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}
# the layer count of the Gemma model whose attention scale llama.cpp takes as hidden / heads (27B)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# metadata keys transformers' GGUF tables leave out that change the math: {arch}.KEY -> config field
_EXTRA_FIELDS = {"attention.sliding_window": "sliding_window", "attn_logit_softcapping": "attn_logit_softcapping",
                 "final_logit_softcapping": "final_logit_softcapping",
                 "expert_feed_forward_length": "moe_intermediate_size"}


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
    require_gguf()
    return PreTrainedTokenizerFast.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
