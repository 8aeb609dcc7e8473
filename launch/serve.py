"""An OpenAI-compatible HTTP server on rank 0 (completions, chat completions, models, health, metrics).

Two processes: rank 0 runs the engine loop, and starts the HTTP process (serving/frontend.py) beside it; they
talk over ZMQ on local sockets in a directory only this user can enter.

    python -m nanovllm_tp.launch.serve                                  # the embedded tiny checkpoint
    python -m nanovllm_tp.launch.serve --model DIR --port 8000 --api-key KEY
    ./torchrun.sh 2 -m nanovllm_tp.launch.serve --tp 2 --model DIR     # rank 0 serves HTTP, rank 1 plans
    python -m nanovllm_tp.launch.serve --model DIR -dp 2               # two replicas, one endpoint

With --data-parallel-size D the processes are those of launch/serve_replicas.py, on one node or under torchrun.

Binds to 127.0.0.1 unless --host says otherwise. SIGTERM or Ctrl-C stops the server and every rank between two
steps: open requests end with an error (not drained), the command exits with 0. A step that does not end within
--shutdown-timeout seconds (a stuck rank) is not waited for: every rank is killed, what they shared removed, and
the command exits with 143.

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
from nanovllm_tp.bench.common import apply_threads
from nanovllm_tp.config.engine_config import add_engine_args
from nanovllm_tp.launch.generate import build_llm
from nanovllm_tp.serving.server_config import ServerConfig, add_server_args, lora_modules, server_config
from nanovllm_tp.serving.shutdown import StopSignals, hard_stop
from nanovllm_tp.utils.proctitle import PREFIX, rank_title, set_title

GOMP_SPINCOUNT = "10000"      # libgomp's spins before an idle thread sleeps (see the docstring)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    add_server_args(parser)
    # a data-parallel replica's own process (serving/replica_processes.py starts it): index and sockets
    parser.add_argument("--replica", help=argparse.SUPPRESS)
    return parser


def engine_threads(args, ranks: int | None = None) -> bool:
    """The engine's threads: --threads, else OMP_NUM_THREADS, else on CPU this node's cores shared by its `ranks`
    (default: torchrun's local world size, else --tensor-parallel-size x --pipeline-parallel-size); args.threads
    says it from then on. Returns whether the engine runs on CPU (see http_at_idle)."""
    import torch
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if args.threads is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        args.threads = int(os.environ["OMP_NUM_THREADS"])
    if args.threads is None and on_cpu:
        if ranks is None:
            ranks = int(os.environ.get("LOCAL_WORLD_SIZE", args.tensor_parallel_size * args.pipeline_parallel_size))
        args.threads = envs.cores_per_rank(ranks)
    apply_threads(args)                  # this process, and OMP_NUM_THREADS (= --threads if given) for the ranks
    return on_cpu


def http_at_idle(server: ServerConfig, on_cpu: bool, threads: int | None) -> bool:
    """Whether the HTTP process runs at idle priority: --http-priority idle, or auto with CPU ranks of several
    threads each. A rank of one thread has no parallel region to hold up, and ranks that fill every core with one
    thread each (data-parallel replicas) would leave an idle-priority HTTP process no gap at all."""
    return server.http_priority == "idle" or (server.http_priority == "auto" and on_cpu and threads != 1)


def start_front(server: ServerConfig, name: str, endpoints: list[tuple[str, str]], idle: bool,
                secret: bytes | None = None) -> subprocess.Popen:
    """The HTTP process (at idle priority if asked): it imports and connects while the engine loads, and serves
    once told what; `endpoints`: each replica's (commands, outputs). The API key, and the secret of replicas on
    other nodes, go in its environment, never on its command line."""
    private = ("NANOVLLM_TP_API_KEY", "NANOVLLM_TP_SECRET", "NANOVLLM_TP_SECRET_FILE")
    env = {k: v for k, v in os.environ.items() if k not in private}
    if server.api_key:
        env["NANOVLLM_TP_API_KEY"] = server.api_key
    if secret is not None:
        env["NANOVLLM_TP_SECRET"] = secret.decode()
    return subprocess.Popen(
        [sys.executable, "-m", "nanovllm_tp.serving.frontend", "--commands", *(c for c, _ in endpoints),
         "--outputs", *(o for _, o in endpoints), "--name", name, "--config", server.to_json(),
         *(["--idle-priority"] if idle else [])], env=env)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        server = server_config(args)
        if server.data_parallel_size > 1 and args.pipeline_parallel_size > 1:
            raise ValueError("--data-parallel-size with --pipeline-parallel-size is not implemented yet: run "
                             "pipeline-parallel replicas as separate servers")
        loras = lora_modules(server)
        if (loras or server.allow_runtime_lora_updating) and not args.enable_lora:
            raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"serve: {exc}") from None
    server.api_key = server.api_key or envs.get("NANOVLLM_TP_API_KEY") or None
    if args.device != "cuda":            # before torch loads libgomp (a GPU rank hardly runs OpenMP regions)
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from nanovllm_tp.distributed.launch import launched_by_torchrun
    from nanovllm_tp.launch import serve_replicas
    if args.replica is not None:
        serve_replicas.serve_replica(args, server, loras)
    elif server.data_parallel_size > 1 and launched_by_torchrun():
        serve_replicas.serve_torchrun_rank(args, server, loras)
    elif server.data_parallel_size > 1:
        serve_replicas.serve_replicas(args, server, argv)
    elif int(os.environ.get("RANK", "0")) != 0:
        engine_threads(args)
        set_title(rank_title(int(os.environ["RANK"])))
        serve_plans(args)          # under torchrun, ranks > 0 serve plans in here and exit with rank 0
    else:
        set_title(f"{PREFIX}::serve" if not launched_by_torchrun() else rank_title(0))
        serve_engine(args, server, loras, engine_threads(args))


def serve_engine(args, server: ServerConfig, loras, on_cpu: bool, secret: bytes | None = None) -> None:
    """Rank 0 of the one engine, with the HTTP process beside it, until a signal or the HTTP process's death.
    Under torchrun with data-parallel replicas (torchrun_replicas.py), rank 0 of replica 0: the other replicas
    register in torchrun's store, and the HTTP process starts once every one has (with `secret`, which their
    sockets' keys come from); stopping tells them to stop."""
    from nanovllm_tp.distributed import torchrun_replicas
    from nanovllm_tp.distributed.launch import stop_children
    from nanovllm_tp.serving.engine_loop import EngineLoop
    replicas = torchrun_replicas.current()
    rundir = tempfile.mkdtemp(prefix=f"nanovllm_tp-serve-{os.getpid()}-")    # 0700: only this user gets in
    commands, outputs = f"ipc://{rundir}/commands", f"ipc://{rundir}/outputs"
    idle = http_at_idle(server, on_cpu, args.threads)
    name = server.served_model_name or args.model or "tiny"
    front, llm, loop, signals = None, None, None, None
    try:
        if replicas is None:             # its imports overlap the engine's loading
            front = start_front(server, name, [(commands, outputs)], idle)
        llm = build_llm(args)
        # from now on a signal stops the loop between two steps; a step stuck past shutdown_timeout is cut short
        signals = StopSignals(server.shutdown_timeout, lambda: hard_stop(front, llm, rundir))
        try:
            loop = EngineLoop(llm, commands, outputs, lambda: front is None or front.poll() is None, loras)
        except ValueError as exc:       # an adapter of --lora-modules
            raise SystemExit(f"serve: --lora-modules: {exc}") from None
        if replicas is not None:
            endpoints = [(commands, outputs), *(tuple(e) for e in torchrun_replicas.others_endpoints())]
            front = start_front(server, name, endpoints, idle, secret)
        loop.run(lambda: not signals.received)
        if signals.received:
            loop.stop(f"the server is shutting down ({signal.Signals(signals.received[0]).name})")
    finally:
        if replicas is not None:
            torchrun_replicas.stop_all("rank 0 stopped")
        if front is not None:
            stop_children([front], timeout=0)        # SIGTERM, then SIGKILL if it lingers
        if loop is not None:
            loop.close()
        if llm is not None:
            llm.close()
        shutil.rmtree(rundir, ignore_errors=True)
        if signals is not None:
            signals.finished()
    if not signals.received:
        raise SystemExit(f"the HTTP process exited with {front.returncode}")
    logging.getLogger("nanovllm_tp").info("rank 0: stopped by %s", signal.Signals(signals.received[0]).name)
    sys.exit(0)


def serve_plans(args) -> None:
    """A torchrun rank > 0: run plans until rank 0 shuts the engine down; SIGTERM (torchrun passes it on to every
    rank) ends it quietly, with one line."""
    try:
        build_llm(args)
    except SystemExit as exc:
        if exc.code != 128 + signal.SIGTERM:
            raise
        logging.getLogger("nanovllm_tp").info("rank %s: stopped by SIGTERM", os.environ.get("RANK"))
        sys.exit(0)


if __name__ == "__main__":
    main()
