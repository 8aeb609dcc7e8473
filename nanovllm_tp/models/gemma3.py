"""Gemma 3 (text): Gemma 2's layers with (1 + weight) RMSNorms on every query and key head before RoPE, a RoPE
base of its own for the sliding-window layers (rope_parameters per layer type, read by ModelConfig), five
windowed layers to one global by default, and no logit caps unless the config sets them."""
from nanovllm_tp.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @classmethod
    def config_options(cls, hf_config) -> dict:
        return {**super().config_options(hf_config), "qk_norm": True}
