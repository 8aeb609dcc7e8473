"""`serve --data-parallel-size D`: D engine replicas behind one endpoint, in the three kinds of process that make
such a server (serve.py's main picks one):

- on one node, the command's own process (`serve_replicas`): it runs no engine, but starts the HTTP process and D
  replica processes (serving/replica_processes.py), and watches them;
- one such replica process (`serve_replica`): its LLM of --tensor-parallel-size ranks and its engine loop, on the
  sockets the supervisor gave it;
- under torchrun, every rank (`serve_torchrun_rank`): D x T ranks over one node or several, each in the process
  group of its own replica (distributed/torchrun_replicas.py). Rank 0 of replica 0 runs the HTTP process as one
  engine's server does (serve.serve_engine); rank 0 of every other replica binds its engine loop on its node's
  address with CURVE (serving/replica_link.py), registers it in torchrun's store, and serves until rank 0 says
  stop or is gone; the other ranks run plans.

Under torchrun a replica is not started again when it dies: torchrun's agent stops that node's ranks (its policy
for a failed rank), and the server goes on with the replicas left (/health says degraded).
"""
import logging
import os
import shutil
import signal
import sys
import tempfile
import time

from nanovllm_tp.launch.generate import build_llm
from nanovllm_tp.serving.http_priority import HttpPriority
from nanovllm_tp.launch.engine_server import engine_threads, http_at_idle, serve_engine, serve_plans, start_front
from nanovllm_tp.serving.replica_processes import NOT_STARTED, RANK_KILLED
from nanovllm_tp.serving.rolling_restart import RollingRestart
from nanovllm_tp.serving.server_config import ServerConfig
from nanovllm_tp.serving.shutdown import StopSignals, hard_stop
from nanovllm_tp.utils.proctitle import PREFIX, REPLICA_ENV, rank_title, set_title

log = logging.getLogger("nanovllm_tp")
WATCH_S = 0.2                 # how often the supervisor looks at its replicas and HTTP process
REPLICA_EXIT_S = 5.0          # beyond --shutdown-timeout, how long a stopping replica may take to exit (its own cut
                              # of a stuck step, its interpreter's exit: an idle one took 1.3-3 s on 2 busy cores)
STOP_CHECK_S = 1.0            # how often a torchrun replica asks torchrun's store whether rank 0 said stop


def serve_replicas(args, server: ServerConfig, argv: list[str]) -> None:
    """One node: the HTTP process and D replica processes, which share this node's cores; this process only
    watches them. Exits as a one-engine server does: 0 after a signal, 143 if a replica had to be cut short; and
    non-zero with one line when the server cannot go on (a replica that could not start, none left, the HTTP
    process gone)."""
    from nanovllm_tp.distributed.launch import stop_children
    from nanovllm_tp.serving.replica_processes import ReplicaProcesses
    set_title(f"{PREFIX}::serve")
    size = server.data_parallel_size
    on_cpu = engine_threads(args, size * args.tensor_parallel_size)
    rundir = tempfile.mkdtemp(prefix=f"nanovllm_tp-serve-{os.getpid()}-")    # 0700: only this user gets in
    endpoints = [(f"ipc://{rundir}/commands-{i}", f"ipc://{rundir}/outputs-{i}") for i in range(size)]
    idle = http_at_idle(server, on_cpu, args.threads)
    replicas = ReplicaProcesses(argv, endpoints, args.threads, server.restart_dead_replicas, rundir)
    front = start_front(server, server.served_model_name or args.model or "tiny", endpoints, idle)
    # this process runs no engine: the replicas' work counts as load too, and lifts the HTTP process while they run
    watcher = HttpPriority.watch(front.pid) if idle else None
    # Each replica cuts its own stuck step short after --shutdown-timeout (its StopSignals), counted from when it
    # got the signal, after this process did; so this process waits that long and REPLICA_EXIT_S more for them,
    # and its own watcher is only the last resort, for a main thread that hangs past those waits.
    signals = StopSignals(server.shutdown_timeout + 2 * REPLICA_EXIT_S,
                          lambda: (replicas.kill(), stop_children([front], timeout=0),
                                   shutil.rmtree(rundir, ignore_errors=True)))
    rolling = RollingRestart(replicas)
    signal.signal(signal.SIGHUP, lambda signum, frame: rolling.request())
    why, unclean = None, {}
    try:
        replicas.start_all()
        while not signals.received:
            why = f"the HTTP process exited with {front.returncode}" if front.poll() is not None else replicas.watch()
            if why is not None:
                break
            rolling.step()
            time.sleep(WATCH_S)
    finally:
        if watcher is not None:
            watcher.stop()
        if front.poll() is None:
            front.terminate()               # it stops while the replicas do
        unclean = replicas.stop(server.shutdown_timeout + REPLICA_EXIT_S)
        stop_children([front], timeout=0)
        shutil.rmtree(rundir, ignore_errors=True)
        signals.finished()
    if why is not None:
        raise SystemExit(f"serve: {why}")
    if unclean:
        log.error("serve: %s did not stop cleanly; exit code 143", ", ".join(
            f"replica {i} (exit code {code})" for i, code in sorted(unclean.items())))
        sys.exit(128 + signal.SIGTERM)
    log.info("serve: stopped by %s", signal.Signals(signals.received[0]).name)
    sys.exit(0)


def serve_replica(args, server: ServerConfig, loras) -> None:
    """One replica process of a one-node server: its LLM and engine loop on the sockets it was given, until
    SIGTERM or until the process that started it is gone. An engine that fails while serving ends the process
    (exit 1), which the supervisor starts again; one that fails before it served (whatever the cause) ends it with
    NOT_STARTED and one line of why, written to --replica-report for the supervisor, which then stops the server
    rather than start it again and again."""
    from nanovllm_tp.serving.engine_loop import EngineLoop
    index, commands, outputs = args.replica.split(",", 2)
    set_title(rank_title(0, index))
    os.environ[REPLICA_ENV] = index          # the ranks it spawns title themselves after it
    restart = []                             # SIGUSR1: the supervisor's rolling restart
    signal.signal(signal.SIGUSR1, lambda signum, frame: restart.append(signum))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)     # a hang-up of the whole group is the supervisor's to handle
    engine_threads(args)
    supervisor = os.getppid()
    serving = False

    def loop_of(llm):
        nonlocal serving
        loop = EngineLoop(llm, commands, outputs, lambda: os.getppid() == supervisor, loras, exit_when_dead=True)
        serving = True
        _report(args.replica_ready, str(os.getpid()))
        return loop
    try:
        _run_replica(args, server, loras, f"replica {index}", loop_of, restart=lambda: bool(restart))
    except SystemExit as exc:
        if serving or not isinstance(exc.code, str):    # 143: a SIGTERM while it loads (the server stops)
            raise
        why = exc.code.removeprefix(f"serve: replica {index}: ")
    except Exception as exc:
        if serving:
            raise
        why = f"{type(exc).__name__}: {exc}"
    else:
        return
    why = " ".join(why.split())                      # one line, whatever the exception said
    if not _report(args.replica_report, why):        # started by hand, or the server is gone: say it here
        print(f"serve: replica {index} could not start: {why}", file=sys.stderr)
    sys.exit(NOT_STARTED)


def _report(path: str | None, text: str) -> bool:
    """Whether `text` reached the supervisor's file (why the replica could not start; its pid once it serves)."""
    if path is None:
        return False
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError:
        return False
    return True


def serve_torchrun_rank(args, server: ServerConfig, loras) -> None:
    """A rank of a data-parallel server under torchrun (the module docstring)."""
    from nanovllm_tp.distributed import torchrun_replicas
    from nanovllm_tp.distributed.trust import ChannelKeys
    from nanovllm_tp.serving.engine_loop import EngineLoop
    from nanovllm_tp.serving.replica_link import reachable_address
    try:
        placement = torchrun_replicas.place(server.data_parallel_size, args.tensor_parallel_size)
    except ValueError as exc:
        raise SystemExit(f"serve: {exc}") from None
    set_title(rank_title(placement.rank, placement.replica))
    on_cpu = engine_threads(args)
    if placement.rank != 0:
        serve_plans(args)
        return
    secret = torchrun_replicas.front_secret()
    if placement.replica == 0:
        serve_engine(args, server, loras, on_cpu, secret)
        return
    host = reachable_address(os.environ["MASTER_ADDR"])
    where = f"tcp://[{host}]:*" if ":" in host else f"tcp://{host}:*"
    rank0_alive = _Every(STOP_CHECK_S, lambda: not torchrun_replicas.told_to_stop())

    registered = False

    def loop_of(llm):
        nonlocal registered
        loop = EngineLoop(llm, where, where, rank0_alive, loras, keys=secret and ChannelKeys(secret),
                          replica=placement.replica, exit_when_dead=True)
        torchrun_replicas.register(loop.endpoints)
        registered = True
        return loop
    try:
        _run_replica(args, server, loras, f"replica {placement.replica}", loop_of)
    except BaseException as exc:
        if not registered:              # rank 0 waits for this replica: tell it why it never will come
            torchrun_replicas.report_failure(f"{type(exc).__name__}: {exc}")
        raise


def _run_replica(args, server: ServerConfig, loras, name: str, make_loop, restart=lambda: False) -> None:
    """A replica's engine and loop (`make_loop(llm)`), until SIGTERM, until its HTTP process is gone, or until
    `restart()` (then its open requests move to the other replicas, and it exits 0 to be started again)."""
    llm, loop, signals = None, None, None
    try:
        llm = build_llm(args)
        signals = StopSignals(server.shutdown_timeout, lambda: hard_stop(None, llm, None))
        try:
            loop = make_loop(llm)
        except ValueError as exc:       # an adapter of --lora-modules
            raise SystemExit(f"serve: {name}: --lora-modules: {exc}") from None
        loop.run(lambda: not signals.received and not restart())
        if loop.failed:     # on its way out (to be started again): a stop from now on finds it no longer serving
            _report(args.replica_ready, "")
        if signals.received:
            loop.stop(f"{name} is shutting down ({signal.Signals(signals.received[0]).name})")
        elif restart():
            loop.stop(f"{name} is restarting", restart=True, migrate=server.migrate_kv_on_restart,
                      interrupted=lambda: bool(signals.received))
    finally:
        if loop is not None:
            loop.close()
        if llm is not None:
            llm.close()
        if signals is not None:
            signals.finished()
    if loop is not None and loop.failed:
        if loop.rank_killed:             # not this replica's own failure: the supervisor starts it again, uncounted
            print(f"serve: {name}: {loop.failed}", file=sys.stderr)
            sys.exit(RANK_KILLED)
        raise SystemExit(f"serve: {name}: {loop.failed}")


class _Every:
    """A check asked often (every send wait, every idle poll) but answered at most once per `period` seconds."""

    def __init__(self, period: float, check):
        self.period, self.check = period, check
        self._at, self._value = 0.0, True

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self._at >= self.period:
            self._at, self._value = now, self.check()
        return self._value
