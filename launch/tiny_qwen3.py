"""The Qwen3 presets of make_tiny: their shapes, the HF config, random weights under HF Qwen3 names, and the
safetensors files (one, or shards balanced by bytes with their index). Init stds are chosen so greedy decoding
is not decided by near-ties (make_tiny's docstring has the measured margins)."""
from __future__ import annotations

import pathlib

import torch
from safetensors.torch import save_file

from nanovllm_tp.launch.tiny_tokenizer import write_json

PRESETS = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, torch_dtype="float32"),
    "small": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=64, tie_word_embeddings=False, torch_dtype="bfloat16"),
    # Qwen3-0.6B's shape and vocabulary size (the tokenizer stays the tiny BPE): for throughput on a GPU
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       torch_dtype="bfloat16"),
}
# Tuned with --report-margin (sweep of EMBED_STD x PROJ_GAIN, seeds 0-2). The logit
# spread is ~EMBED_STD * sqrt(hidden_size) and top-1 gaps scale with it, but with tied
# weights a large embedding lets the current token's own row win, so greedy decoding
# repeats it; PROJ_GAIN > 1 makes the layers, not the input embedding, dominate the
# residual stream. EMBED_STD 0.7 / gain 2.0 keeps the median margin > 1.3 with 30+
# distinct tokens in every 64-token continuation.
EMBED_STD = 0.7          # absolute std of embed_tokens (and of an untied lm_head)
PROJ_GAIN = 2.0          # every projection: std = PROJ_GAIN / sqrt(fan_in)
NORM_NOISE_STD = 0.05    # norm weights are 1 + noise, so a dropped norm weight is caught
QUIET_GAIN = 0.05        # output projections of the layers past --quiet-from (a draft's target)


def build_config(preset: str, vocab_size: int, eos_id: int, overrides: dict) -> dict:
    config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=vocab_size,
                  hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
                  rope_theta=1e6, rope_scaling=None, attention_bias=False, attention_dropout=0.0,
                  use_cache=True, use_sliding_window=False, sliding_window=None,
                  bos_token_id=eos_id, eos_token_id=eos_id, initializer_range=0.02)
    config.update(PRESETS[preset])
    config.update(overrides)
    # transformers >= 5 reads rope/dtype from these keys; older versions from the legacy ones.
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    config["torch_dtype"] = config["dtype"] = overrides.get("dtype", config["torch_dtype"])
    config.setdefault("max_window_layers", config["num_hidden_layers"])
    return config


def random_weights(config: dict, seed: int, quiet_from: int | None = None) -> dict[str, torch.Tensor]:
    """HF Qwen3 parameter names and shapes, filled from a generator seeded by `seed` (so a deeper checkpoint of
    the same seed shares the shallower one's embedding and first layers). Layers from `quiet_from` on write
    QUIET_GAIN times less into the residual stream: such a checkpoint stays close to, not equal to, the one of
    `quiet_from` layers, which then makes a draft model for it with most but not all proposals right."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def linear(out_features, in_features):
        return torch.randn(out_features, in_features, generator=generator) * (PROJ_GAIN / in_features**0.5)

    def norm(size):
        return 1.0 + NORM_NOISE_STD * torch.randn(size, generator=generator)

    weights = {"model.embed_tokens.weight": EMBED_STD * torch.randn(config["vocab_size"], hidden, generator=generator)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        attn_shapes = {"q_proj": (q_dim, hidden), "k_proj": (kv_dim, hidden),
                       "v_proj": (kv_dim, hidden), "o_proj": (hidden, q_dim)}
        quiet = QUIET_GAIN if quiet_from is not None and i >= quiet_from else 1.0
        for name, shape in attn_shapes.items():
            weights[f"{prefix}self_attn.{name}.weight"] = linear(*shape) * (quiet if name == "o_proj" else 1.0)
            if config["attention_bias"]:
                weights[f"{prefix}self_attn.{name}.bias"] = 0.1 * torch.randn(shape[0], generator=generator)
        weights[prefix + "self_attn.q_norm.weight"] = norm(head_dim)
        weights[prefix + "self_attn.k_norm.weight"] = norm(head_dim)
        weights[prefix + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[prefix + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[prefix + "mlp.down_proj.weight"] = linear(hidden, inter) * quiet
        weights[prefix + "input_layernorm.weight"] = norm(hidden)
        weights[prefix + "post_attention_layernorm.weight"] = norm(hidden)
    weights["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = EMBED_STD * torch.randn(config["vocab_size"], hidden, generator=generator)
    dtype = getattr(torch, config["torch_dtype"])
    return {name: tensor.to(dtype).contiguous() for name, tensor in weights.items()}


def save_weights(weights: dict[str, torch.Tensor], out_dir: pathlib.Path, num_shards: int) -> None:
    if not 1 <= num_shards <= len(weights):
        raise ValueError(f"num_shards must be in 1..{len(weights)}, got {num_shards}")
    for stale in out_dir.glob("model*.safetensors*"):  # a rerun with other shards must not mix files
        stale.unlink()
    if num_shards == 1:
        save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
        return
    sizes = {name: t.numel() * t.element_size() for name, t in weights.items()}
    total, written, groups = sum(sizes.values()), 0, [[]]
    for i, name in enumerate(weights):  # whole tensors, balanced by bytes, no shard left empty
        shards_to_open, tensors_left = num_shards - len(groups), len(weights) - i
        if groups[-1] and shards_to_open and (written >= total * len(groups) / num_shards
                                              or tensors_left == shards_to_open):
            groups.append([])
        groups[-1].append(name)
        written += sizes[name]
    weight_map = {}
    for index, names in enumerate(groups, start=1):
        filename = f"model-{index:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: weights[n] for n in names}, out_dir / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, filename))
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_json(out_dir / "model.safetensors.index.json", index_json)
