"""Write small GGUF files for the tests (llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3), the way llama.cpp's converter lays them out:
Llama's q/k rows permuted (pairs of rotary halves interleaved per head), Gemma's norms stored as 1 + weight, 2-D
weights quantized (Q8_0 unless told: `qtype` for the linear layers, `embed_qtype` for the embedding and LM head,
Q8_0 by default as SmolLM2's file), norms in F32, no output.weight when the embedding is tied, the tiny BPE
tokenizer as a gpt2-style vocabulary with merges; a window and logit caps in the metadata where the config
has them."""
import json

import numpy as np

from nanovllm_tp.launch import k_quants


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_model, tokenizer_dir, path, arch: str = "llama", extra_metadata: dict | None = None,
               qtype: str = "Q8_0", embed_qtype: str = "Q8_0", layer_qtypes: dict | None = None):
    """layer_qtypes: {part of an HF name ("down_proj"): its type} over qtype, as llama.cpp's mixes (Q4_K_M:
    ffn_down and attn_v in Q6_K)."""
    import gguf
    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    partial = (getattr(cfg, "rope_parameters", None) or {}).get("partial_rotary_factor") or 1.0
    writer.add_rope_dimension_count(int(cfg.head_dim * partial))
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)      # Gemma 3: its global layers'
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, key, None):
            writer.add_float32(f"{arch}.{key}", getattr(cfg, key))
    if getattr(cfg, "num_experts", None):
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    for key, value in (extra_metadata or {}).items():
        writer.add_key_value(key, *value)
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    special = {t["id"] for t in tok["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_add_bos_token(False)
    gguf_arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(gguf_arch, cfg.num_hidden_layers)
    for hf_name, tensor in _expert_stacks(hf_model.state_dict(), cfg):
        base, _, suffix = hf_name.rpartition(".")
        if base == "lm_head" and cfg.tie_word_embeddings:
            continue
        w = tensor.float().numpy()
        if arch == "llama" and base.endswith("q_proj"):
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and base.endswith("k_proj"):
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        elif arch.startswith("gemma") and "norm" in base:
            w = w + 1
        name = f"{names.get_name(base) or base}.{suffix}"
        if w.ndim >= 2:
            chosen = next((t for part, t in (layer_qtypes or {}).items() if part in base), qtype)
            kind = gguf.GGMLQuantizationType[embed_qtype if "embed" in base or "lm_head" in base else chosen]
            data = k_quants.quantize(w, kind.name) if kind.name.endswith("_K") else gguf.quants.quantize(w, kind)
            writer.add_tensor(name, data, raw_dtype=kind)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _expert_stacks(state: dict, cfg):
    """The state dict with a layer's fused experts (transformers' gate_up_proj [experts, 2 * inter, hidden] and
    down_proj) as llama.cpp's three stacks, blk.N.ffn_{gate,up,down}_exps."""
    for name, tensor in state.items():
        if ".mlp.experts." not in name:
            yield name, tensor
            continue
        layer = int(name.split(".")[2])
        if name.endswith("gate_up_proj"):
            inter = cfg.moe_intermediate_size
            yield f"blk.{layer}.ffn_gate_exps.weight", tensor[:, :inter]
            yield f"blk.{layer}.ffn_up_exps.weight", tensor[:, inter:]
        else:
            yield f"blk.{layer}.ffn_down_exps.weight", tensor
