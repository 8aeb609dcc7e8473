"""One engine behind the HTTP front, as `serve` runs it without data-parallel replicas, and the pieces the
replicas' launcher (serve_replicas.py) shares: the engine's threads, the HTTP process's priority and start, rank
0's engine loop beside it, and a torchrun rank > 0 serving plans. Why the HTTP process may run at idle priority:
serve.py's docstring."""
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from nanovllm_tp import envs
from nanovllm_tp.config import cpu_threads
from nanovllm_tp.bench.common import apply_threads
from nanovllm_tp.launch.generate import build_llm
from nanovllm_tp.serving.http_priority import HttpPriority
from nanovllm_tp.serving.server_config import ServerConfig
from nanovllm_tp.serving.shutdown import StopSignals, hard_stop


def engine_threads(args, ranks: int | None = None) -> bool:
    """The engine's threads: --threads, else OMP_NUM_THREADS, else on CPU this node's cores shared by its `ranks`
    (default: torchrun's local world size, else --tensor-parallel-size x --pipeline-parallel-size); args.threads
    says it from then on. Where none is given the count is a ceiling the ranks follow the load under
    (config/cpu_threads.py). Returns whether the engine runs on CPU (see http_at_idle)."""
    import torch
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if args.threads is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        args.threads = int(os.environ["OMP_NUM_THREADS"])
    if args.threads is None and on_cpu:
        ranks = ranks or local_ranks(args)
        args.threads = envs.cores_per_rank(ranks)
        os.environ["NANOVLLM_TP_THREADS_AUTO"] = str(ranks)    # a ceiling: the ranks follow the load under it
    elif args.threads is not None and not getattr(args, "replica", None):
        os.environ.pop("NANOVLLM_TP_THREADS_AUTO", None)     # given: fixed (a replica inherits its supervisor's)
    apply_threads(args)                  # this process, and OMP_NUM_THREADS (= --threads if given) for the ranks
    return on_cpu


def local_ranks(args) -> int:
    """This node's engine ranks: torchrun's local world size, else --tensor-parallel-size x
    --pipeline-parallel-size."""
    return envs.local_ranks(args.tensor_parallel_size * args.pipeline_parallel_size)


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
    front = subprocess.Popen(
        [sys.executable, "-m", "nanovllm_tp.serving.frontend", "--commands", *(c for c, _ in endpoints),
         "--outputs", *(o for _, o in endpoints), "--name", name, "--config", server.to_json(),
         *(["--idle-priority"] if idle else [])], env=env)
    cpu_threads.count_as_own(front.pid)    # its CPU time is the server's own, not load the engine makes way for
    return front


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
    front, llm, loop, signals, watcher = None, None, None, None, None
    try:
        if replicas is None:             # its imports overlap the engine's loading
            front = start_front(server, name, [(commands, outputs)], idle)
            watcher = HttpPriority.watch(front.pid, local_ranks(args)) if idle else None
        llm = build_llm(args)
        # from now on a signal stops the loop between two steps; a step stuck past shutdown_timeout is cut short
        signals = StopSignals(server.shutdown_timeout, lambda: hard_stop(front, llm, rundir))
        signal.signal(signal.SIGHUP, lambda signum, frame: logging.getLogger("nanovllm_tp").warning(
            "SIGHUP: a rolling restart needs --data-parallel-size 2 or more (one engine has none to move its "
            "requests to); ignored"))
        try:
            loop = EngineLoop(llm, commands, outputs, lambda: front is None or front.poll() is None, loras)
        except ValueError as exc:       # an adapter of --lora-modules
            raise SystemExit(f"serve: --lora-modules: {exc}") from None
        if replicas is not None:
            endpoints = [(commands, outputs), *(tuple(e) for e in torchrun_replicas.others_endpoints())]
            front = start_front(server, name, endpoints, idle, secret)
            watcher = HttpPriority.watch(front.pid, local_ranks(args)) if idle else None
        loop.run(lambda: not signals.received)
        if signals.received:
            loop.stop(f"the server is shutting down ({signal.Signals(signals.received[0]).name})")
    finally:
        if watcher is not None:
            watcher.stop()
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
