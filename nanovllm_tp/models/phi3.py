"""Phi-3 and Phi-4-mini: Llama's graph, with q, k, v fused in one qkv_proj and gate and up in one gate_up_proj in
the checkpoint (split here into the parts our merged layers load), a partial rotary factor (Phi-4-mini rotates
3/4 of each head) and a sliding window on every layer when the config sets one. LongRoPE (the 128k-context
configs) switches its frequencies with the sequence length and is refused by name (rope_type 'longrope')."""
from nanovllm_tp.layers.weight_loading import RowRange
from nanovllm_tp.models.blocks import CausalLM


class Phi3ForCausalLM(CausalLM):
    partial_rotary = True

    def __init__(self, cfg):
        super().__init__(cfg)
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.fused = {"qkv_proj": (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)),
                      "gate_up_proj": (("gate_proj", 0, cfg.intermediate_size),
                                       ("up_proj", cfg.intermediate_size, cfg.intermediate_size))}

    def checkpoint_parts(self, name: str, loaded):
        for fused, parts in self.fused.items():
            if f".{fused}." in name:
                for piece, start, size in parts:
                    yield name.replace(f".{fused}.", f".{piece}."), RowRange(loaded, start, size)
                return
        yield name, loaded
