"""The record of where a benchmark ran, written with its figures: date, host, CPU, threads, load average at the
start and the end, the memory read bandwidth at the run's thread count (bench/bandwidth.py), library versions,
the commit (and whether the tree was dirty), how it was launched."""
from __future__ import annotations

import datetime
import os
import pathlib
import platform
import socket
import subprocess
import sys

from nanovllm_tp.bench.bandwidth import read_bandwidth
from nanovllm_tp.layers.cpu_features import cpu_model


def _git_commit() -> str | None:
    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=False)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=False)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    import torch
    env = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "read_bandwidth": read_bandwidth(torch.get_num_threads()),
        "cuda": torch.cuda.is_available(),
        "git_commit": _git_commit(),
        "launched_by": "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ else "python",
        "argv": sys.argv,
    }
    from importlib.metadata import PackageNotFoundError, version
    for module in ("transformers", "nanovllm_tp", "triton", "flash_attn"):
        try:
            env[module] = version("nanovllm-tp" if module == "nanovllm_tp" else module)
        except PackageNotFoundError:
            env[module] = None
    if env["cuda"]:
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def finish_environment(env: dict) -> dict:
    if hasattr(os, "getloadavg"):
        env["loadavg_at_end"] = list(os.getloadavg())
    return env
