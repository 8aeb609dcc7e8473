"""Building csrc/ into one shared library: compiled once per machine with the C compiler into the user's cache
directory, keyed by the sources, headers, compiler, flags and CPU, so a changed source or another CPU model builds
anew and ranks that build at once each install a whole file. layers/cpu_kernels.py loads the result with ctypes.

Work done once per machine says so in one line (`first_run_notice`: the compile here, the kernel table's
measurement in kernel_choice.py), so that a first run that takes seconds is not taken for a hang; a cached build
and table print nothing.
"""
import hashlib
import importlib.resources
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

from nanovllm_tp import envs
from nanovllm_tp.layers import cpu_features

_CSRC = importlib.resources.files("nanovllm_tp.layers") / "csrc"
SOURCES = [_CSRC / name for name in ("cpu_kernels.c", "kv_store.c", "sampler.c", "linear.c", "linear_q.c",
                                     "lora.c", "decode_attn.c", "decode_attn_simd.c", "decoder.c",
                                     "read_rate.c")]
# included by the sources: copied beside them and part of the build's key
HEADERS = [_CSRC / name for name in ("simd.h", "dtypes.h", "decode_attn.h", "layer_kernels.h", "lora.h")]
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]

# Its own handler at INFO, not passed on to the root logger: shown whatever logging the application set up (none,
# for a script calling LLM(...)), once; logging.getLogger("nanovllm_tp.first_run").setLevel(logging.WARNING)
# silences it.
_first_run = logging.getLogger("nanovllm_tp.first_run")
_first_run.setLevel(logging.INFO)
_first_run.propagate = False
if not _first_run.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("nanovllm_tp: %(message)s"))
    _first_run.addHandler(_handler)


def first_run_notice(message: str) -> None:
    """One line on stderr for work that a later run finds cached (rank 0's only)."""
    from nanovllm_tp.distributed.parallel_state import tp_rank
    if tp_rank() == 0:
        _first_run.info(message)


def compiler() -> str | None:
    """The C compiler's path: $CC, else cc; None where neither is found."""
    return shutil.which(envs.get("CC") or "cc")


def cache_dir() -> pathlib.Path:
    root = envs.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "nanovllm_tp"


def _cpu_signature() -> str:
    """-march=native code must not be reused on another CPU model (a shared home directory, say)."""
    return cpu_features.flags_line()


def build_library(compiler: str) -> pathlib.Path:
    """Compile the kernels unless a build for these sources, compiler, flags and CPU exists; return its path."""
    sources = {src.name: src.read_bytes() for src in SOURCES + HEADERS}
    key = hashlib.sha256(b"\0".join([*sources.values(), compiler.encode(), " ".join(CFLAGS).encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    target = cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    first_run_notice(f"compiling the CPU kernels once for this machine (about 20 s; cached in {target.parent})...")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        for name, text in sources.items():
            (pathlib.Path(tmp) / name).write_bytes(text)
        paths = [str(pathlib.Path(tmp) / src.name) for src in SOURCES]
        built = pathlib.Path(tmp) / target.name
        result = subprocess.run([compiler, *CFLAGS, "-o", str(built), *paths, "-lm"], capture_output=True,
                                text=True, timeout=600)
        if result.returncode:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)     # atomic: ranks building at once each install a whole file
    return target
