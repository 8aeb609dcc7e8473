"""Model registry keyed by the `architectures` entry of a HF config.json: one file per architecture on the
shared blocks of models/blocks.py. A new architecture is one file plus one line here."""
import importlib

ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}


def model_class(architecture: str):
    return getattr(importlib.import_module(f"nanovllm_tp.models.{ARCHITECTURES[architecture]}"), architecture)
