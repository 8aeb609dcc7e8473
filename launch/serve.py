"""An OpenAI-compatible HTTP server on rank 0 (completions, chat completions, models, health, metrics).

Two processes: rank 0 runs the engine loop, and starts the HTTP process (serving/frontend.py) beside it; they
talk over ZMQ on local sockets in a directory only this user can enter.

    python -m nanovllm_tp.launch.serve                                  # the embedded tiny checkpoint
    python -m nanovllm_tp.launch.serve --model DIR --port 8000 --api-key KEY
    ./torchrun.sh 2 -m nanovllm_tp.launch.serve --tp 2 --model DIR     # rank 0 serves HTTP, rank 1 plans

Binds to 127.0.0.1 unless --host says otherwise. SIGTERM or Ctrl-C stops the server and every rank at once
(open requests are not drained).

On CPU the engine and the HTTP process share every core. The engine's ranks take all of them, as offline
generation does, and the HTTP process runs at idle priority (SCHED_IDLE): it gets a core whenever an engine thread
leaves one (between two parallel regions, while rank 0 schedules) and never holds up an OpenMP thread, whose
parallel regions would all wait for it. libgomp's threads spin GOMP_SPINCOUNT times before they sleep; its default
(300,000) leaves too few such gaps (HTTP starved), so serve sets 10,000 unless the environment gives one. Other
busy processes on those cores also come first; on a shared machine `--http-priority normal` keeps HTTP level
with them.
"""
import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from nanovllm_tp import envs
from nanovllm_tp.config import add_engine_args
from nanovllm_tp.launch.bench_common import apply_threads
from nanovllm_tp.launch.generate import build_llm

GOMP_SPINCOUNT = "10000"      # libgomp's spins before an idle thread sleeps (see the docstring)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=envs.get("NANOVLLM_TP_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $NANOVLLM_TP_API_KEY)")
    parser.add_argument("--served-model-name", help="the model name clients use (default: --model or 'tiny')")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="beyond this many waiting requests, new ones get 429")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--threads", type=int,
                        help="CPU threads per rank (default: $OMP_NUM_THREADS, else this node's cores shared by its "
                             "ranks; the HTTP process uses what they leave idle)")
    parser.add_argument("--http-priority", choices=["auto", "idle", "normal"], default="auto",
                        help="the HTTP process's CPU priority: idle runs it only where nothing else wants a core; "
                             "auto: idle when the engine runs on CPU, else normal")
    return parser


def engine_threads(args) -> bool:
    """The engine's threads: --threads, else OMP_NUM_THREADS, else on CPU this node's cores shared by its ranks.
    Returns whether the engine runs on CPU (then --http-priority auto means idle)."""
    import torch
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if args.threads is None and on_cpu and not os.environ.get("OMP_NUM_THREADS"):
        args.threads = envs.cores_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", args.tensor_parallel_size)))
    apply_threads(args)                  # this process, and OMP_NUM_THREADS (= --threads if given) for the ranks
    return on_cpu


def start_front(args, commands: str, outputs: str, idle: bool) -> subprocess.Popen:
    """The HTTP process (at idle priority if asked): it imports and connects while the engine loads, and serves
    once told what."""
    env = {k: v for k, v in os.environ.items() if k != "NANOVLLM_TP_API_KEY"}
    if args.api_key:
        env["NANOVLLM_TP_API_KEY"] = args.api_key
    return subprocess.Popen(
        [sys.executable, "-m", "nanovllm_tp.serving.frontend", "--commands", commands, "--outputs", outputs,
         "--name", args.served_model_name or args.model or "tiny", "--host", args.host, "--port", str(args.port),
         "--max-waiting-requests", str(args.max_waiting_requests), "--log-level", args.log_level,
         *(["--idle-priority"] if idle else [])], env=env)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.max_waiting_requests < 1:
        raise SystemExit("--max-waiting-requests must be >= 1")
    if args.device != "cuda":            # before torch loads libgomp (a GPU rank hardly runs OpenMP regions)
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    on_cpu = engine_threads(args)        # refuses --threads < 1 (apply_threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if int(os.environ.get("RANK", "0")) != 0:
        build_llm(args)            # under torchrun, ranks > 0 serve plans in here and exit with rank 0
        return
    from nanovllm_tp.distributed.launch import stop_children
    from nanovllm_tp.serving.engine_loop import EngineLoop
    rundir = tempfile.mkdtemp(prefix=f"nanovllm_tp-serve-{os.getpid()}-")    # 0700: only this user gets in
    commands, outputs = f"ipc://{rundir}/commands", f"ipc://{rundir}/outputs"
    stop, front, llm, loop = [], None, None, None
    try:
        idle = args.http_priority == "idle" or (args.http_priority == "auto" and on_cpu)
        front = start_front(args, commands, outputs, idle)
        llm = build_llm(args)
        for sig in (signal.SIGTERM, signal.SIGINT):     # from now on, stop between two steps, not inside one
            signal.signal(sig, lambda signum, frame: stop.append(signum))
        loop = EngineLoop(llm, commands, outputs)
        loop.run(lambda: not stop and front.poll() is None)
    finally:
        if front is not None:
            stop_children([front], timeout=0)        # SIGTERM, then SIGKILL if it lingers
        if loop is not None:
            loop.close()
        if llm is not None:
            llm.close()
        shutil.rmtree(rundir, ignore_errors=True)
    if not stop:
        raise SystemExit(f"the HTTP process exited with {front.returncode}")
    sys.exit(0)


if __name__ == "__main__":
    main()
