"""KV cache allocation and sizing from a memory budget."""
import torch


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V, on one rank."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
    """Zeroed, so never-written slots (the null slot, padding) hold finite values that masking can cancel."""
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    """Usable blocks for a budget; one more block is reserved as the null block."""
    return max(0, budget_bytes // block_bytes - 1)


def gpu_kv_budget(total_bytes: int, utilization: float, used_bytes_now: int, peak_extra_bytes: int) -> int:
    """What is left for KV under total*utilization, after the weights (in use now) and the warm-up peak
    above them (activations of a max_num_batched_tokens forward)."""
    return int(total_bytes * utilization) - used_bytes_now - peak_extra_bytes
