#!/usr/bin/env bash
# Launch an nanovllm_tp program on N local ranks:  ./torchrun.sh N script.py ARGS...   or   ./torchrun.sh N -m module ARGS...
# (torchrun itself, through launch/torchrun.py: a SIGTERM ends with one line, not a traceback.)
# Extra torchrun flags go in TORCHRUN_ARGS (e.g. TORCHRUN_ARGS="--nnodes 2 --node-rank 0 --master-addr HOST").
set -euo pipefail
if [[ $# -lt 2 || ! "$1" =~ ^[0-9]+$ ]]; then
    echo "usage: $0 NUM_RANKS (script.py | -m module) [args...]" >&2
    exit 2
fi
nproc="$1"; shift
if [[ -z "${TORCHRUN_ARGS:-}" ]]; then
    TORCHRUN_ARGS="--standalone"
fi
# One OpenMP thread per rank unless told otherwise: CPU ranks share the machine's cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / nproc > 0 ? $(nproc) / nproc : 1 ))}"
# shellcheck disable=SC2086
exec "${PYTHON:-python3}" -m nanovllm_tp.launch.torchrun $TORCHRUN_ARGS --nproc-per-node "$nproc" "$@"
