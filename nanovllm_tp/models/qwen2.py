"""Qwen2: Llama's graph with a bias on the q, k and v projections (always; o_proj has none)."""
from nanovllm_tp.models.blocks import CausalLM


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def config_options(cls, hf_config) -> dict:
        return {**super().config_options(hf_config), "attention_bias": True, "o_proj_bias": False}
