"""The HTTP process of the server, started by launch/serve.py on rank 0 once the engine is up:

    python -m nanovllm_tp.serving.frontend --commands ipc://... --outputs ipc://... --model PATH --name NAME
        --max-model-len N --host H --port P [--max-waiting-requests N] [--log-level L]

The API key comes in the environment (NANOVLLM_TP_API_KEY), not on a command line others can read. It exits
when told to (SIGTERM, from the engine process) and on its own when the engine process is gone (then it also
removes the sockets' directory, which the engine process would have removed).
"""
import argparse
import asyncio
import logging
import os
import shutil

from nanovllm_tp.serving.app import ServedModel, build_app
from nanovllm_tp.serving.engine_client import EngineClient

PARENT_CHECK_S = 0.5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--commands", required=True)
    p.add_argument("--outputs", required=True)
    p.add_argument("--model", required=True, help="the engine's model path (tokenizer, /v1/models root)")
    p.add_argument("--name", required=True, help="the model name clients use")
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-waiting-requests", type=int, default=1024)
    p.add_argument("--log-level", default="warning")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import uvicorn
    from nanovllm_tp.loader import load_tokenizer
    engine = EngineClient(args.commands, args.outputs, args.max_waiting_requests)
    model = ServedModel(args.name, args.model, args.max_model_len, load_tokenizer(args.model))
    app = build_app(engine, model, os.environ.get("NANOVLLM_TP_API_KEY") or None)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=1))
    parent = os.getppid()

    async def watch():
        announced = False
        while not server.should_exit:
            if not announced and server.started:
                print(f"nanovllm_tp serving {args.name!r} on http://{args.host}:{args.port}/v1", flush=True)
                announced = True
            if os.getppid() != parent:          # the engine process is gone: nothing left to serve
                shutil.rmtree(os.path.dirname(args.commands.removeprefix("ipc://")), ignore_errors=True)
                server.should_exit = True
            await asyncio.sleep(PARENT_CHECK_S if announced else 0.05)

    async def run():
        watching = asyncio.ensure_future(watch())
        await server.serve()
        watching.cancel()

    asyncio.run(run())


if __name__ == "__main__":
    main()
