"""The attention layer of every model: write this step's K/V into the paged cache, then attend through the
backend the runner bound (one per engine: two engines in a process may use different backends)."""
import torch
from torch import nn

from nanovllm_tp.layers.attention.base import AttentionBackend
from nanovllm_tp.layers.attention.kv_quant import store_quantized
from nanovllm_tp.utils.context import get_context


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


class Attention(nn.Module):
    """window: this layer's sliding window (0: it attends to the whole context); softcap: its attention logit
    cap (0: none). See base.py for both."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int = 0,
                 softcap: float = 0.0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.window, self.softcap = window, softcap
        self.k_cache = self.v_cache = torch.tensor([])   # bound by the runner after KV allocation
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None   # a quantized cache's (K, V) scales
        self.backend: AttentionBackend | None = None     # bound by the runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if self.kv_scales is not None:
            # a prefill attends to its own K/V as the cache holds them, so that it sees what later steps see
            k, v = store_quantized(k, v, self.k_cache, self.v_cache, self.kv_scales, ctx.slot_mapping,
                                   readback=ctx.is_prefill)
        elif self.k_cache.numel():
            store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, ctx, self.scale, self.window, self.softcap,
                                    self.kv_scales)
