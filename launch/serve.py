"""An OpenAI-compatible HTTP server on rank 0 (completions, chat completions, models, health, metrics).

    python -m nanovllm_tp.launch.serve                                  # the embedded tiny checkpoint
    python -m nanovllm_tp.launch.serve --model DIR --port 8000 --api-key KEY
    ./torchrun.sh 2 -m nanovllm_tp.launch.serve --tp 2 --model DIR     # rank 0 serves HTTP, rank 1 plans

Binds to 127.0.0.1 unless --host says otherwise. SIGTERM or Ctrl-C stops the server and every rank at once
(open requests are not drained).
"""
import argparse
import asyncio
import logging
import os
import sys

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
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.max_waiting_requests < 1:
        raise SystemExit("--max-waiting-requests must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    llm = build_llm(args)          # under torchrun, ranks > 0 serve plans in here and exit with rank 0
    import uvicorn
    from nanovllm_tp.serving.app import build_app
    name = args.served_model_name or args.model or "tiny"
    app = build_app(llm, name, args.api_key, args.max_waiting_requests)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)

    async def announce():
        while not server.started:
            await asyncio.sleep(0.05)
        print(f"nanovllm_tp serving {name!r} on http://{args.host}:{args.port}/v1", flush=True)

    async def run():
        announcing = asyncio.ensure_future(announce())
        await server.serve()
        announcing.cancel()

    try:
        asyncio.run(run())
    finally:
        app.state.engine.shutdown()
        llm.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
