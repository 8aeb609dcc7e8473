"""`flash`: flash-attn's varlen kernel for prefill (through the block table when part of the KV is cached) and
flash_attn_with_kvcache for decode. CUDA only, fp16/bf16, KV blocks a multiple of 256. A quantized KV cache reaches
it dequantized (base.py: the step's blocks copied into the model dtype first; flash-attn 2 reads no fp8 cache)."""
import importlib.util

import torch
import torch.nn.functional as F

from nanovllm_tp.layers.attention.base import HALF, AttentionBackend, register_backend
from nanovllm_tp.layers.attention.kv_quant import ALL_KV_DTYPES


def flash_available() -> bool:
    """flash-attn present and importable (a build for another torch fails at import: fall back then)."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


@register_backend
class FlashBackend(AttentionBackend):
    name = "flash"
    devices = ("cuda",)
    default_block_size = 256
    supports_graphs = True
    kv_dtypes = ALL_KV_DTYPES

    def __init__(self):
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    @classmethod
    def unavailable(cls, dtype, installed: bool | None = None) -> str | None:
        """`installed`: whether flash-attn imports (None: look)."""
        if not (flash_available() if installed is None else installed):
            return "flash-attn is not installed (or does not import)"
        return None if dtype in HALF else f"flash-attn does not support {dtype}"

    @classmethod
    def block_size_problem(cls, block_size: int) -> str | None:
        return None if block_size % 256 == 0 else "flash-attn's paged KV cache needs a multiple of 256"

    def prepare(self, ctx):
        if ctx.is_prefill:      # varlen's key offsets: each row's whole context (cached prefix + new tokens)
            ctx.cu_seqlens_k = F.pad(ctx.context_lens.cumsum(0, dtype=torch.int32), (1, 0))

    def prefill(self, q, k, v, k_cache, v_cache, ctx, scale, window=0, softcap=0.0, kv_scales=None):
        block_table = None
        if ctx.has_cached_prefix:
            k, v, block_table = k_cache, v_cache, ctx.block_tables
        return self.varlen(q, k, v, cu_seqlens_q=ctx.cu_seqlens_q, cu_seqlens_k=ctx.cu_seqlens_k,
                           max_seqlen_q=ctx.max_seqlen_q, max_seqlen_k=ctx.max_seqlen_k,
                           softmax_scale=scale, causal=True, block_table=block_table, **_options(window, softcap))

    def decode(self, q, k_cache, v_cache, ctx, scale, window=0, softcap=0.0, kv_scales=None):
        return self.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=ctx.context_lens,
                                 block_table=ctx.block_tables, softmax_scale=scale, causal=True,
                                 **_options(window, softcap)).squeeze(1)


def _options(window: int, softcap: float) -> dict:
    """flash-attn's keywords for a sliding window (it counts the keys left of the query: window - 1) and a
    logit cap (flash-attn >= 2.6); none for a plain layer, so older versions run those."""
    options = {}
    if window:
        options["window_size"] = (window - 1, 0)
    if softcap:
        options["softcap"] = softcap
    return options
