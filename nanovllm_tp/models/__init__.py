"""Model registry keyed by the `architectures` entry of a HF config.json."""

# Qwen2 and Llama share Qwen3's graph; ModelConfig switches q/k norm and q/k/v bias per architecture.
ARCHITECTURES = {
    "Qwen3ForCausalLM": "nanovllm_tp.models.qwen3:Qwen3ForCausalLM",
    "Qwen2ForCausalLM": "nanovllm_tp.models.qwen3:Qwen3ForCausalLM",
    "LlamaForCausalLM": "nanovllm_tp.models.qwen3:Qwen3ForCausalLM",
}


def model_class(architecture: str):
    import importlib
    module, name = ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module), name)
