"""CUDA attention backends. Imported only on CUDA.

`flash`: flash-attn's varlen kernel for prefill (with block_table when part of the KV is cached) and
flash_attn_with_kvcache for decode. `torch-cuda`, when flash-attn is not in use: torch's varlen attention
for bf16/fp16 prefill without a cached prefix where this torch has it, a Triton paged kernel for every other
prefill (cached prefixes, fp32), and a Triton paged split-K kernel for decode.
"""
import importlib.util
import inspect
import logging

import torch

from nanovllm_tp.layers.attention import TorchBackend

log = logging.getLogger("nanovllm_tp")
HALF = (torch.float16, torch.bfloat16)


def flash_block_size_problem(block_size: int) -> str | None:
    """Why flash-attn's paged KV cache cannot use this block size, or None when it can."""
    return None if block_size % 256 == 0 else "flash-attn's paged KV cache needs a multiple of 256"


def triton_block_size_problem(block_size: int) -> str | None:
    """Why the torch-cuda backend (Triton kernels) cannot use this block size, or None when it can."""
    if block_size & (block_size - 1) == 0 and 8 <= block_size <= 1024:
        return None
    return "the torch-cuda backend's Triton kernels need a power of two in [8, 1024]"


def pick_cuda_backend(dtype: torch.dtype, block_size: int | None, flash_ok: bool, forced: str | None) -> str:
    """'flash' or 'torch-cuda' for this dtype and block size (None: the backend's default), given whether
    flash-attn imports; `forced` is NANOVLLM_TP_ATTENTION. An explicit block size that flash-attn cannot use
    picks torch-cuda (and says so); one that no backend can use is a ValueError naming what each needs."""
    flash_usable = flash_ok and dtype in HALF
    why_not_flash = ("flash-attn is not installed (or does not import)" if not flash_ok else
                     f"flash-attn does not support {dtype}" if not flash_usable else
                     None if block_size is None else flash_block_size_problem(block_size))
    if forced == "flash":
        if why_not_flash:
            raise ValueError(f"NANOVLLM_TP_ATTENTION=flash, but {why_not_flash}"
                             + (f" (kvcache_block_size={block_size})" if flash_usable else ""))
        return "flash"
    if forced != "torch-cuda" and why_not_flash is None:
        return "flash"
    why_not_triton = None if block_size is None else triton_block_size_problem(block_size)
    if why_not_triton:
        status = "installed" if flash_usable else why_not_flash
        raise ValueError(f"kvcache_block_size={block_size} fits no CUDA attention backend: "
                         f"{flash_block_size_problem(block_size) or 'flash-attn would take it'} ({status}); "
                         f"{why_not_triton}")
    if forced != "torch-cuda":
        log.warning("attention backend torch-cuda (torch varlen prefill, Triton paged kernels): %s%s",
                    why_not_flash, f", kvcache_block_size={block_size}" if flash_usable else "")
    return "torch-cuda"


def flash_available() -> bool:
    """flash-attn present and importable (a build for another torch fails at import: fall back then)."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


class FlashBackend:
    name = "flash"

    def __init__(self):
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def check_block_size(self, block_size: int) -> None:
        if flash_block_size_problem(block_size):
            raise ValueError(f"{flash_block_size_problem(block_size)} as kvcache_block_size, got {block_size}")

    supports_graphs = True

    def forward(self, q, k, v, k_cache, v_cache, ctx, scale):
        if ctx.is_prefill:
            block_table = None
            if ctx.has_cached_prefix:
                k, v, block_table = k_cache, v_cache, ctx.block_tables
            return self.varlen(q, k, v, cu_seqlens_q=ctx.cu_seqlens_q, cu_seqlens_k=ctx.cu_seqlens_k,
                               max_seqlen_q=ctx.max_seqlen_q, max_seqlen_k=ctx.max_seqlen_k,
                               softmax_scale=scale, causal=True, block_table=block_table)
        return self.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=ctx.context_lens,
                                 block_table=ctx.block_tables, softmax_scale=scale, causal=True).squeeze(1)


def _torch_varlen():
    """torch's varlen attention and the names of its keyword arguments, or (None, ()) where this torch has
    none or one without a softmax scale argument (torch 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, ()
    params = tuple(inspect.signature(varlen_attn).parameters)
    return (varlen_attn, params) if "scale" in params else (None, ())


class CudaTorchBackend(TorchBackend):
    name = "torch-cuda"
    supports_graphs = True

    def __init__(self):
        from nanovllm_tp.layers.triton_decode import paged_decode_attention
        from nanovllm_tp.layers.triton_prefill import paged_prefill_attention
        self.decode_kernel, self.prefill_kernel = paged_decode_attention, paged_prefill_attention
        self.varlen, self.varlen_params = _torch_varlen()

    def check_block_size(self, block_size: int) -> None:
        if triton_block_size_problem(block_size):
            raise ValueError(f"{triton_block_size_problem(block_size)} as kvcache_block_size, got {block_size}")

    def forward(self, q, k, v, k_cache, v_cache, ctx, scale):
        if not ctx.is_prefill:
            return self._decode(q, k_cache, v_cache, ctx, scale)
        if self.varlen is not None and not ctx.has_cached_prefix and q.dtype in HALF:
            return self._varlen_prefill(q, k, v, ctx, scale)
        if k_cache.numel():      # a cached prefix, fp32, or no varlen: the paged kernel, no score matrix
            return self.prefill_kernel(q, k_cache, v_cache, ctx.block_tables, ctx.cu_seqlens_q, ctx.context_lens,
                                       ctx.max_seqlen_q, scale)
        return self._prefill(q, k, v, k_cache, v_cache, ctx, scale)

    def _decode(self, q, k_cache, v_cache, ctx, scale):
        return self.decode_kernel(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale)

    def _varlen_prefill(self, q, k, v, ctx, scale):
        kwargs = {"scale": scale}
        if "is_causal" in self.varlen_params:
            kwargs["is_causal"] = True
        else:
            kwargs["window_size"] = (-1, 0)
        if k.shape[1] != q.shape[1]:
            if "enable_gqa" in self.varlen_params:
                kwargs["enable_gqa"] = True
            else:
                repeat = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return self.varlen(q, k, v, ctx.cu_seqlens_q, ctx.cu_seqlens_q, ctx.max_seqlen_q, ctx.max_seqlen_q,
                           **kwargs)
