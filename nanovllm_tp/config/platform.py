"""Where and how a rank computes: device, dtype and attention backend, read from its EngineConfig. Rank 0's
engine and every worker resolve them with these functions, each from its own copy of the config."""
import os

import torch

from nanovllm_tp.layers.attention.base import AttentionBackend
from nanovllm_tp.layers.attention.registry import select_backend

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device_and_dtype(config) -> tuple[torch.device, torch.dtype]:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if config.dtype != "auto":
        dtype = DTYPES[config.dtype]
    elif use_cuda:
        dtype = DTYPES.get(config.model_config.torch_dtype.replace("torch.", ""), torch.bfloat16)
    else:
        dtype = torch.float32
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError("float16 is not supported on CPU; use float32 or bfloat16")
    return device, dtype


def resolve_attention_backend(config, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend config.attention_backend names (or auto's choice); config then names it, with the block size
    it runs at, so that the ranks rank 0 starts get the same pair."""
    backend = select_backend(device, dtype, config.kvcache_block_size, config.attention_backend,
                             config.kv_cache_dtype)
    config.kvcache_block_size = backend.fit_block_size(config.kvcache_block_size)
    config.attention_backend = backend.name
    backend.every_row_as_decode = config.batch_invariant
    return backend
