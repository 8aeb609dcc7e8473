"""An OpenAI-compatible HTTP server on rank 0 (completions, chat completions, models, health, metrics).

Two processes: rank 0 runs the engine loop, and starts the HTTP process (serving/frontend.py) beside it; they
talk over ZMQ on local sockets in a directory only this user can enter.

    python -m nanovllm_tp.launch.serve                                  # the embedded tiny checkpoint
    python -m nanovllm_tp.launch.serve --model DIR --port 8000 --api-key KEY
    ./torchrun.sh 2 -m nanovllm_tp.launch.serve --tp 2 --model DIR     # rank 0 serves HTTP, rank 1 plans

Binds to 127.0.0.1 unless --host says otherwise. SIGTERM or Ctrl-C stops the server and every rank at once
(open requests are not drained).
"""
import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from nanovllm_tp.distributed.launch import stop_children
from nanovllm_tp.launch.bench_common import apply_threads
from nanovllm_tp.launch.generate import add_engine_args, build_llm


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("NANOVLLM_TP_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $NANOVLLM_TP_API_KEY)")
    parser.add_argument("--served-model-name", help="the model name clients use (default: --model or 'tiny')")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="beyond this many waiting requests, new ones get 429")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--threads", type=int,
                        help="CPU threads per rank (default: $OMP_NUM_THREADS, else this node's cores but one, "
                             "shared by its ranks: the core left over runs the HTTP process)")
    return parser


def reserve_a_core(args) -> int | None:
    """On CPU, the engine's OpenMP threads stall whenever one of them waits for a core (every parallel region
    waits for its slowest thread), so the HTTP process gets a core of its own: by default the engine runs one
    thread per core on all cores but one. Whenever the engine's threads (--threads, else OMP_NUM_THREADS, else
    that default) leave a core free, this process and the workers it spawns are bound to the others and the HTTP
    process to the last one. Returns that core, or None (a GPU, no core to spare)."""
    import torch
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", args.tp))
    if args.threads is None and on_cpu and not os.environ.get("OMP_NUM_THREADS"):
        args.threads = max(1, ((len(cores) or os.cpu_count() or 1) - 1) // ranks)
    apply_threads(args)                  # this process, and OMP_NUM_THREADS (= --threads if given) for the ranks
    omp = os.environ.get("OMP_NUM_THREADS", "")
    threads = int(omp) if omp.isdigit() else 0
    if not on_cpu or len(cores) < 2 or not 0 < threads * ranks < len(cores):
        return None
    bind(os.getpid(), set(cores[:-1]))
    return cores[-1]


def bind(pid: int, cores: set[int]) -> None:
    """Every thread of process pid to these cores (threads it starts later inherit the binding)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cores)


def start_front(args, commands: str, outputs: str, core: int | None) -> subprocess.Popen:
    """The HTTP process (on the reserved core, if any): it imports and connects while the engine loads, and
    serves once told what."""
    env = {k: v for k, v in os.environ.items() if k != "NANOVLLM_TP_API_KEY"}
    if args.api_key:
        env["NANOVLLM_TP_API_KEY"] = args.api_key
    front = subprocess.Popen(
        [sys.executable, "-m", "nanovllm_tp.serving.frontend", "--commands", commands, "--outputs", outputs,
         "--name", args.served_model_name or args.model or "tiny", "--host", args.host, "--port", str(args.port),
         "--max-waiting-requests", str(args.max_waiting_requests), "--log-level", args.log_level], env=env)
    if core is not None:
        bind(front.pid, {core})
    return front


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.max_waiting_requests < 1:
        raise SystemExit("--max-waiting-requests must be >= 1")
    reserved = reserve_a_core(args)      # refuses --threads < 1 (apply_threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if int(os.environ.get("RANK", "0")) != 0:
        build_llm(args)            # under torchrun, ranks > 0 serve plans in here and exit with rank 0
        return
    from nanovllm_tp.serving.engine_loop import EngineLoop
    rundir = tempfile.mkdtemp(prefix=f"nanovllm_tp-serve-{os.getpid()}-")    # 0700: only this user gets in
    commands, outputs = f"ipc://{rundir}/commands", f"ipc://{rundir}/outputs"
    stop, front, llm, loop = [], None, None, None
    try:
        front = start_front(args, commands, outputs, reserved)
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
