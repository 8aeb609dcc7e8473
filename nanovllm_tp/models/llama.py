"""Llama 2 / 3 / 3.1 / 3.2 (rope scaling `llama3` is read by ModelConfig); attention_bias biases q, k, v and o,
mlp_bias gate, up and down."""
from nanovllm_tp.models.blocks import CausalLM


class LlamaForCausalLM(CausalLM):
    @classmethod
    def config_options(cls, hf_config) -> dict:
        return {**super().config_options(hf_config), "mlp_bias": bool(getattr(hf_config, "mlp_bias", False))}
