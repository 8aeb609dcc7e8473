"""Qwen3 (dense): Llama's graph with an RMSNorm on every query and key head before RoPE."""
from nanovllm_tp.models.blocks import CausalLM


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def config_options(cls, hf_config) -> dict:
        return {**super().config_options(hf_config), "qk_norm": True}
