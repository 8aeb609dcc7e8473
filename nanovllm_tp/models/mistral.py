"""Mistral: Llama's graph; its sliding window is checked against max_model_len by EngineConfig."""
from nanovllm_tp.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
