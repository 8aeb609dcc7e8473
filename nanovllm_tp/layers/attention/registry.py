"""Attention backends by name, and the choice of one for a device, dtype and KV block size.

Every module of this package is imported once on first use, so a backend's `@register_backend` line is all it
takes to make it selectable. "auto" picks, on CUDA, flash-attn when it imports and takes the dtype and block size
(an explicit kvcache_block_size it cannot use picks torch-cuda), else torch-cuda; on CPU the C-kernel backend
where the kernels build for the dtype, else torch.
"""
import functools
import importlib
import logging
import pathlib
import pkgutil

import torch

from nanovllm_tp.layers.attention.base import BACKENDS, AttentionBackend
from nanovllm_tp.layers.attention.flash import flash_available

log = logging.getLogger("nanovllm_tp")
AUTO = "auto"


@functools.cache
def _import_backends() -> None:
    for info in pkgutil.iter_modules([str(pathlib.Path(__file__).parent)]):
        importlib.import_module(f"{__package__}.{info.name}")


def backend_names() -> list[str]:
    _import_backends()
    return sorted(BACKENDS)


def check_backend_name(name) -> None:
    """TypeError/ValueError for anything but "auto" or a registered name (EngineConfig.validate)."""
    if not isinstance(name, str):
        raise TypeError(f"attention_backend must be a str, got {type(name).__name__}")
    if name != AUTO and name not in backend_names():
        raise ValueError(f"attention_backend must be {AUTO!r} or one of {', '.join(map(repr, backend_names()))}, "
                         f"got {name!r}")


def backend_class(name: str) -> type[AttentionBackend]:
    check_backend_name(name)
    if name == AUTO:
        raise ValueError(f"{AUTO!r} names no backend: select_backend makes that choice")
    return BACKENDS[name]


def select_backend(device: torch.device, dtype: torch.dtype, block_size: int | None,
                   requested: str = AUTO, kv_cache_dtype: str = "auto") -> AttentionBackend:
    """An instance of the asked backend (or of auto's choice), or a ValueError saying why it cannot run here
    (a kv_cache_dtype it does not take included). The block size is checked by the caller
    (`AttentionBackend.fit_block_size`), except on CUDA, where it steers auto's choice."""
    backend = _select(device, dtype, block_size, requested)
    problem = backend.kv_dtype_problem(kv_cache_dtype)
    if problem:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} with attention_backend={backend.name}: {problem}")
    if kv_cache_dtype != "auto" and not backend.reads_quantized:
        log.warning("kv_cache_dtype=%s: the %s backend's kernels read dense caches, so each step dequantizes the "
                    "KV blocks it reads into %s first (correct, not fast; no CUDA graphs)", kv_cache_dtype,
                    backend.name, str(dtype).removeprefix("torch."))
    return backend


def _select(device: torch.device, dtype: torch.dtype, block_size: int | None, requested: str) -> AttentionBackend:
    if requested != AUTO:
        cls = backend_class(requested)
        if device.type not in cls.devices:
            usable = [n for n in backend_names() if device.type in BACKENDS[n].devices]
            raise ValueError(f"attention_backend={requested} runs on {' or '.join(cls.devices)}, not "
                             f"{device.type} (there: {AUTO}, {', '.join(usable)})")
    if device.type == "cuda" and requested != "torch":
        name = pick_cuda_backend(dtype, block_size, flash_available(), None if requested == AUTO else requested)
    elif requested == AUTO:
        name = "cpu" if backend_class("cpu").unavailable(dtype) is None else "torch"
    else:
        name = requested
        why = backend_class(name).unavailable(dtype)
        if why:
            raise ValueError(f"attention_backend={name}, but {why}")
    return backend_class(name)()


def pick_cuda_backend(dtype: torch.dtype, block_size: int | None, flash_ok: bool, forced: str | None) -> str:
    """'flash' or 'torch-cuda' for this dtype and block size (None: the backend's default), given whether
    flash-attn imports; `forced`: the asked backend, None for auto. An explicit block size that flash-attn cannot
    use picks torch-cuda (and says so); one that no backend can use is a ValueError naming what each needs."""
    flash, triton = backend_class("flash"), backend_class("torch-cuda")
    why_not_flash = flash.unavailable(dtype, installed=flash_ok)
    flash_usable = why_not_flash is None
    if why_not_flash is None and block_size is not None:
        why_not_flash = flash.block_size_problem(block_size)
    if forced == "flash":
        if why_not_flash:
            raise ValueError(f"attention_backend=flash, but {why_not_flash}"
                             + (f" (kvcache_block_size={block_size})" if flash_usable else ""))
        return "flash"
    if forced != "torch-cuda" and why_not_flash is None:
        return "flash"
    why_not_triton = None if block_size is None else triton.block_size_problem(block_size)
    if why_not_triton:
        status = "installed" if flash_usable else why_not_flash
        raise ValueError(f"kvcache_block_size={block_size} fits no CUDA attention backend: "
                         f"{flash.block_size_problem(block_size) or 'flash-attn would take it'} ({status}); "
                         f"{why_not_triton}")
    if forced != "torch-cuda":
        log.warning("attention backend torch-cuda (torch varlen prefill, Triton paged kernels): %s%s",
                    why_not_flash, f", kvcache_block_size={block_size}" if flash_usable else "")
    return "torch-cuda"
