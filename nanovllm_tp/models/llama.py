"""Llama 2 / 3 / 3.1 / 3.2 (rope scaling `llama3` is read by ModelConfig). `mlp_bias` is not implemented."""
from nanovllm_tp.models.blocks import CausalLM


class LlamaForCausalLM(CausalLM):
    @classmethod
    def config_options(cls, hf_config) -> dict:
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not implemented (the gated MLP has no biases)")
        return super().config_options(hf_config)
