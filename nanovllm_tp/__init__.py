"""nanovllm-tp: a small LLM inference engine with tensor parallelism.

`LLM` is imported lazily so that `nanovllm_tp.scheduler` (pure Python + numpy) never pulls in torch.
"""
__version__ = "0.1.0"

from nanovllm_tp.lora import LoRARequest
from nanovllm_tp.pooling.params import PoolingParams
from nanovllm_tp.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput", "PoolingParams",
           "EmbeddingRequestOutput", "EmbeddingOutput"]


def __getattr__(name):
    if name == "LLM":
        from nanovllm_tp.entrypoints.llm import LLM
        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from nanovllm_tp import outputs
        return getattr(outputs, name)
    if name in ("EmbeddingRequestOutput", "EmbeddingOutput"):
        from nanovllm_tp.pooling import embeddings as pooling
        return getattr(pooling, name)
    raise AttributeError(f"module 'nanovllm_tp' has no attribute {name!r}")
