"""KV cache allocation and sizing from a memory budget."""
import torch

from nanovllm_tp.layers.attention.kv_quant import SCALE_DTYPE, kv_storage_dtype, kv_token_head_bytes


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   kv_cache_dtype: str = "auto") -> int:
    """Bytes one block takes across all layers, K and V (and a quantized cache's scales), on one rank."""
    return 2 * num_layers * block_size * num_kv_heads * kv_token_head_bytes(kv_cache_dtype, head_dim, dtype)


def allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                      kv_cache_dtype: str = "auto"):
    """(k, v, scales): [num_layers, num_blocks, block_size, num_kv_heads, head_dim] each, and for a quantized
    cache its (K, V) fp32 scales [num_layers, num_blocks, block_size, num_kv_heads] (None for "auto"). Zeroed, so
    never-written slots (the null slot, padding) hold finite values that masking can cancel."""
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    storage = kv_storage_dtype(kv_cache_dtype, dtype)
    k, v = (torch.zeros(shape, dtype=storage, device=device) for _ in range(2))
    if storage is dtype:
        return k, v, None
    return k, v, tuple(torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device) for _ in range(2))


def blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    """Usable blocks for a budget; one more block is reserved as the null block."""
    return max(0, budget_bytes // block_bytes - 1)


def gpu_kv_budget(total_bytes: int, utilization: float, used_bytes_now: int, peak_extra_bytes: int) -> int:
    """What is left for KV under total*utilization, after the weights (in use now) and the warm-up peak
    above them (activations of a max_num_batched_tokens forward)."""
    return int(total_bytes * utilization) - used_bytes_now - peak_extra_bytes
