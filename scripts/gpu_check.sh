#!/usr/bin/env bash
# One command for the CUDA checks and throughput figures: python -m nanovllm_tp.launch.gpu_check "$@"
# ($PYTHON if set, else python, else python3). --dry-run: the same checks on the CPU. The check starts each of
# its parts through this script too (--part NAME), so parts import the package the same way as the parent.
# Works from a bare checkout too (no pip install): nanovllm_tp.launch/.bench/.workers/.scheduler live in top-level
# folders that setup.cfg maps into the package, so without an install the module is started through a
# small bootstrap that adds the repository root to the package path.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NVTP_REPO="$PWD"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then       # fresh images often have python3 only
    if command -v python >/dev/null 2>&1; then PY=python; else PY=python3; fi
fi
if "$PY" -c "import nanovllm_tp.launch.gpu_check" 2>/dev/null; then
    exec "$PY" -m nanovllm_tp.launch.gpu_check "$@"
fi
exec "$PY" -c '
import os, runpy, sys
root = os.environ["NVTP_REPO"]
sys.path.insert(0, root)
import nanovllm_tp
nanovllm_tp.__path__.append(root)
runpy.run_module("nanovllm_tp.launch.gpu_check", run_name="__main__", alter_sys=True)
' "$@"
