"""The HTTP process of the server, started by launch/serve.py on rank 0 before the engine loads:

    python -m nanovllm_tp.serving.frontend --commands ipc://... --outputs ipc://... --name NAME
        --config SERVER_CONFIG_JSON [--idle-priority]

With data-parallel replicas, one --commands and one --outputs endpoint each, in replica order (replica_set.py);
a replica on another node has tcp:// endpoints, reached with CURVE keys derived from the engine secret (given in
this process's environment, NANOVLLM_TP_SECRET; replica_link.py).

It imports and connects at once, then waits for the engine's "ready" message (model path, max_model_len) to load
the tokenizer and start serving.

The API key comes in the environment (NANOVLLM_TP_API_KEY), not on a command line others can read. It exits
when told to (SIGTERM, from the engine process) and on its own when the engine process is gone (then it also
removes the sockets' directory, which the engine process would have removed).
"""
import argparse
import asyncio
import copy
import logging
import os
import shutil
import signal

from nanovllm_tp import envs
from nanovllm_tp.distributed import trust
from nanovllm_tp.serving.app import ServedModel, build_app
from nanovllm_tp.serving.engine_client import EngineClient
from nanovllm_tp.serving.replica_link import client_keys, is_remote
from nanovllm_tp.serving.replica_roles import replica_roles
from nanovllm_tp.serving.replica_set import ReplicaSet
from nanovllm_tp.serving.server_config import ServerConfig
from nanovllm_tp.serving.stats_log import StatsLogger
from nanovllm_tp.utils.proctitle import PREFIX, set_title

PARENT_CHECK_S = 0.5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--commands", required=True, nargs="+", help="each replica's commands endpoint")
    p.add_argument("--outputs", required=True, nargs="+", help="each replica's outputs endpoint, in the same order")
    p.add_argument("--name", required=True, help="the model name clients use")
    p.add_argument("--config", type=ServerConfig.from_json, default=ServerConfig(),
                   help="launch/serve's server flags as JSON (ServerConfig's fields; no API key)")
    p.add_argument("--idle-priority", action="store_true",
                   help="run only on cores the engine leaves idle (SCHED_IDLE; elsewhere nice 19)")
    return p


def lower_priority() -> None:
    """This thread, and every thread started after it, at the lowest CPU priority: SCHED_IDLE where there is
    one (Linux: it runs when a core has nothing else to run, and a waking engine thread takes the core back at
    once), else nice 19. The process that started it moves it back to the normal policy while other processes
    keep the cores busy (serving/http_priority.py): there SCHED_IDLE would never run."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 19)
        except (AttributeError, OSError) as exc:
            logging.getLogger("nanovllm_tp").warning("the HTTP process keeps its priority: %s", exc)


def replica_curves(commands: list[str]) -> list:
    """Each replica's CURVE keys for EngineClient: those of replicas on other nodes (tcp://), from the engine
    secret; None for local ones (and for every one under NANOVLLM_TP_INSECURE=1)."""
    if not any(is_remote(c) for c in commands) or trust.insecure():
        return [None] * len(commands)
    secret = trust.secret_from_env()
    if secret is None:
        raise SystemExit(f"frontend: replicas on other nodes need the engine secret: {trust.HOW_TO}")
    keys = trust.ChannelKeys(secret)
    return [client_keys(keys, i) if is_remote(c) else None for i, c in enumerate(commands)]


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)     # SIGHUP is the command's (a rolling restart), never a stop here
    config = args.config
    config.api_key = envs.get("NANOVLLM_TP_API_KEY") or None
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.idle_priority:
        lower_priority()                 # first: before ZMQ and uvicorn start threads, so they inherit it
    import uvicorn
    from nanovllm_tp.checkpoint.loader import load_tokenizer
    from nanovllm_tp.entrypoints.chat_template import load_chat_template
    parent, rundir = os.getppid(), os.path.dirname(args.commands[0].removeprefix("ipc://"))
    if len(args.commands) != len(args.outputs):
        raise SystemExit("frontend: one --outputs endpoint per --commands endpoint")
    set_title(f"{PREFIX}::http")
    if len(args.commands) == 1:
        engine = EngineClient(args.commands[0], args.outputs[0], config.max_waiting_requests)
    else:
        engine = ReplicaSet(list(zip(args.commands, args.outputs)), config.max_waiting_requests, config.router,
                            curve=replica_curves(args.commands),
                            roles=replica_roles(config.replica_roles, len(args.commands)),
                            rebalance=config.rebalance)
    state = {"server": None}

    def orphaned() -> bool:
        """The engine process is gone (then its sockets' directory goes too): nothing left to serve."""
        if os.getppid() == parent:
            return False
        shutil.rmtree(rundir, ignore_errors=True)
        return True

    async def watch(waiting: asyncio.Task):
        announced = False
        while True:
            server = state["server"]
            if orphaned():
                waiting.cancel()
                if server is not None:
                    server.should_exit = True
                return
            if server is not None and server.started and not announced:
                print(f"nanovllm_tp serving {args.name!r} on http://{config.host}:{config.port}/v1", flush=True)
                announced = True
            await asyncio.sleep(PARENT_CHECK_S if announced else 0.05)

    async def run():
        waiting = asyncio.ensure_future(engine.wait_ready())
        watching = asyncio.ensure_future(watch(waiting))
        try:
            info = await waiting
        except asyncio.CancelledError:
            return
        model = ServedModel(args.name, info["model"], info["max_model_len"],
                            load_tokenizer(info.get("tokenizer") or info["model"]), info.get("loras", []),
                            load_chat_template(config.chat_template), info.get("sampling_defaults") or {})
        app = build_app(engine, model, config)
        server = state["server"] = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                                                 log_level=config.log_level,
                                                                 log_config=uvicorn_logging(),
                                                                 access_log=not config.disable_uvicorn_access_log,
                                                                 timeout_graceful_shutdown=1))
        if not config.disable_uvicorn_access_log:           # its lines whatever the level of uvicorn's own
            access = logging.getLogger("uvicorn.access")
            access.setLevel(min(access.level, logging.INFO))
        server.handle_exit = ending(server.handle_exit, engine, asyncio.get_running_loop())
        logging_stats = None if config.disable_log_stats else \
            asyncio.ensure_future(StatsLogger(engine.labelled_stats, app.state.metrics.token_totals).run())
        await state["server"].serve()
        watching.cancel()
        if logging_stats is not None:
            logging_stats.cancel()

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(run())


def uvicorn_logging() -> dict:
    """uvicorn's own logging configuration, but for its access lines: on stderr, with the rest of the server's log
    (uvicorn writes them to stdout)."""
    from uvicorn.config import LOGGING_CONFIG
    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


def ending(handle_exit, engine: EngineClient, loop):
    """uvicorn's signal handler, which first ends every open request with an error: the engine process's own
    word to that effect may never come (a step it could not finish)."""
    def handle(sig, frame):
        loop.call_soon_threadsafe(engine.fail_all, f"the server is shutting down ({signal.Signals(sig).name})",
                                  True)
        handle_exit(sig, frame)
    return handle


def _loop_factory():
    """uvloop's event loop where it is installed (a dependency off Windows): its socket writes, one per streamed
    chunk, cost a fraction of asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    main()
