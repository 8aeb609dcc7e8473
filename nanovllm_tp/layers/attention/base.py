"""The attention backend interface, and the table of backends by name that each backend module adds itself to
with `@register_backend`.

KV cache layout per layer: [num_blocks, block_size, kv_heads, head_dim] (flash-attn's paged layout). A step's
new K/V are in the cache before `forward` runs (`store_kvcache`), so decode reads everything from the cache.

Two per-layer options every backend implements (0 = off): `window`, a sliding window: the query at position p
sees the keys at positions p - window < j <= p only (transformers' and Mistral's convention; flash-attn's
window_size=(window - 1, 0)); `softcap`, attention logit soft-capping: each scaled score s becomes
softcap * tanh(s / softcap) before the softmax (Gemma 2). Keys before a row's window are never read, so their
blocks' table entries may be stale.

A quantized cache (kv_cache_dtype, see kv_quant.py) comes with `kv_scales`, the (K, V) scale tensors [num_blocks,
block_size, kv_heads]. A backend lists the kv_cache_dtype values it takes in `kv_dtypes`; one whose prefill and
decode read 8-bit caches themselves sets `reads_quantized`, any other gets from `forward` dense copies of the
blocks the step reads (dequantized first: correct everywhere, a copy per step).
"""
import dataclasses
from typing import ClassVar

import torch

from nanovllm_tp.layers.attention.kv_quant import dense_cache
from nanovllm_tp.utils.context import Context

BACKENDS: dict[str, type["AttentionBackend"]] = {}
HALF = (torch.float16, torch.bfloat16)


def register_backend(cls: type["AttentionBackend"]) -> type["AttentionBackend"]:
    """Class decorator: the backend becomes selectable as EngineConfig.attention_backend=cls.name."""
    other = BACKENDS.get(cls.name)
    if other is not None and (other.__module__, other.__qualname__) != (cls.__module__, cls.__qualname__):
        raise RuntimeError(f"two attention backends are named {cls.name!r}: {other.__module__}.{other.__qualname__} "
                           f"and {cls.__module__}.{cls.__qualname__}")
    BACKENDS[cls.name] = cls
    return cls


class AttentionBackend:
    """One way of computing paged attention. Subclasses set the class attributes, `prefill` and `decode`, and
    override the policy hooks where the defaults do not hold. Instances keep no per-step state."""
    name: ClassVar[str]                      # what EngineConfig.attention_backend calls it
    devices: ClassVar[tuple[str, ...]]       # torch device types it runs on
    default_block_size: ClassVar[int] = 16   # the KV block size when kvcache_block_size is None
    supports_graphs: ClassVar[bool] = False  # decode may be captured in CUDA graphs (static shapes, no host reads)
    kv_dtypes: ClassVar[tuple[str, ...]] = ("auto",)    # the kv_cache_dtype values it takes
    reads_quantized: ClassVar[bool] = False  # prefill/decode read 8-bit caches with their kv_scales themselves

    @classmethod
    def unavailable(cls, dtype: torch.dtype) -> str | None:
        """Why it cannot run here for this dtype (a library that does not import, say), or None when it can."""
        return None

    @classmethod
    def block_size_problem(cls, block_size: int) -> str | None:
        """Why it cannot use this KV block size, or None when it can."""
        return None

    @classmethod
    def kv_dtype_problem(cls, kv_cache_dtype: str) -> str | None:
        """Why it cannot keep its KV cache in this format, or None when it can."""
        if kv_cache_dtype in cls.kv_dtypes:
            return None
        return f"the {cls.name} backend takes kv_cache_dtype {', '.join(map(repr, cls.kv_dtypes))} only"

    def fit_block_size(self, block_size: int | None) -> int:
        """The KV block size to use: the asked one when it fits (ValueError if not), else the default."""
        if block_size is None:
            return self.default_block_size
        problem = self.block_size_problem(block_size)
        if problem:
            raise ValueError(f"{problem} as kvcache_block_size, got {block_size}")
        return block_size

    def prepare(self, ctx: Context) -> None:
        """Add to an eager step's context the metadata only this backend reads (replayed decode graphs skip it:
        a backend that captures graphs reads nothing from here in decode)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, ctx: Context, scale: float, window: int = 0,
                softcap: float = 0.0, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [tokens, heads, dim], this step's k/v [tokens, kv_heads, dim] -> [tokens, heads, dim]."""
        if kv_scales is not None and not self.reads_quantized:
            k_cache, v_cache, table = dense_cache(k_cache, v_cache, kv_scales, ctx.block_tables, q.dtype)
            # as_decode (if any) held the paged table's rows: made again from the dense one
            ctx, kv_scales = dataclasses.replace(ctx, block_tables=table, as_decode=None), None
        if ctx.is_prefill:
            return self.prefill(q, k, v, k_cache, v_cache, ctx, scale, window, softcap, kv_scales)
        return self.decode(q, k_cache, v_cache, ctx, scale, window, softcap, kv_scales)

    def prefill(self, q, k, v, k_cache, v_cache, ctx: Context, scale: float, window: int = 0,
                softcap: float = 0.0, kv_scales=None) -> torch.Tensor:
        """Rows of any number of new tokens (a mixed step's decode rows included), causal within each row and
        over the row's cached prefix (within the window, if any)."""
        raise NotImplementedError

    def decode(self, q, k_cache, v_cache, ctx: Context, scale: float, window: int = 0,
               softcap: float = 0.0, kv_scales=None) -> torch.Tensor:
        """One new token per row, over the row's context in the cache (its last `window` tokens, if any)."""
        raise NotImplementedError
