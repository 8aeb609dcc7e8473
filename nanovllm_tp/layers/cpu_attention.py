"""`cpu` attention backend: the torch backend's prefill plus a C kernel for fp32 paged decode.

The kernel (csrc/paged_decode.c) reads each row's K/V in place from the paged cache, where the torch backend
first gathers (and pads) every row's blocks into fresh tensors. It is compiled once per machine with the C
compiler (`$CC`, else `cc`) into the user's cache directory and loaded with ctypes; without a compiler, or for
another dtype, decode falls back to the torch backend's path.
"""
import ctypes
import functools
import hashlib
import importlib.resources
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import torch

from nanovllm_tp.layers.attention import TorchBackend

log = logging.getLogger("nanovllm_tp")
SOURCE = importlib.resources.files("nanovllm_tp.layers") / "csrc" / "paged_decode.c"
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]


def cache_dir() -> pathlib.Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "nanovllm_tp"


def _cpu_signature() -> str:
    """-march=native code must not be reused on another CPU model (a shared home directory, say)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build_kernel(compiler: str) -> pathlib.Path:
    """Compile the kernel unless a build for this source, compiler, flags and CPU exists; return its path."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(CFLAGS).encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    target = cache_dir() / f"paged_decode-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = pathlib.Path(tmp) / "paged_decode.c"
        src.write_bytes(source)
        built = pathlib.Path(tmp) / target.name
        result = subprocess.run([compiler, *CFLAGS, "-o", str(built), str(src), "-lm"], capture_output=True,
                                text=True, timeout=120)
        if result.returncode:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)     # atomic: ranks building at once each install a whole file
    return target


@functools.cache
def load_kernel():
    """The ctypes function, or None (logged once) where it cannot be built here."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler found ($CC or cc): CPU decode attention uses the slower torch path")
        return None
    try:
        fn = ctypes.CDLL(str(build_kernel(compiler))).paged_decode_f32
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("could not build the CPU paged-decode kernel (%s): decode uses the slower torch path", e)
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 5
                   + [ctypes.c_float])
    return fn


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self):
        self.kernel = load_kernel()

    def _decode(self, q, k_cache, v_cache, ctx, scale):
        if self.kernel is None or q.dtype != torch.float32:
            return super()._decode(q, k_cache, v_cache, ctx, scale)
        rows, heads, dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        q = q.contiguous()
        tables = ctx.block_tables.to(torch.int32).contiguous()
        lens = ctx.context_lens.to(torch.int32).contiguous()
        out = torch.empty_like(q)
        if self.kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
                       lens.data_ptr(), out.data_ptr(), rows, heads, kv_heads, dim, block_size, scale):
            raise MemoryError("the CPU paged-decode kernel could not allocate its scratch buffers")
        return out
