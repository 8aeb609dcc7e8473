"""An OpenAI-compatible HTTP server on rank 0 (completions, chat completions, models, health, metrics).

Two processes: rank 0 runs the engine loop, and starts the HTTP process (serving/frontend.py) beside it; they
talk over ZMQ on local sockets in a directory only this user can enter.

    python -m nanovllm_tp.launch.serve                                  # the embedded tiny checkpoint
    python -m nanovllm_tp.launch.serve --model DIR --port 8000 --api-key KEY
    ./torchrun.sh 2 -m nanovllm_tp.launch.serve --tp 2 --model DIR     # rank 0 serves HTTP, rank 1 plans
    python -m nanovllm_tp.launch.serve --model DIR -dp 2               # two replicas, one endpoint
    nanovllm-tp serve HuggingFaceTB/SmolLM2-135M-Instruct               # a hub id: the HF cache, else downloaded

A Hugging Face hub id (org/name, org/name:Q4_K_M for one GGUF file) is resolved once, by this process, before any
rank or replica starts (nanovllm_tp/checkpoint/hub.py; under torchrun every rank runs this command and resolves it
from its node's cache); the server answers to the id as typed unless --served-model-name says otherwise.

With --data-parallel-size D the processes are those of launch/serve_replicas.py, on one node or under torchrun.

What the flags and the model's config files decide alone (a missing model, heads the TP size does not divide, a
feature pipeline stages do not run) is refused before any process starts: one line `serve: why`, exit code 2.

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
import sys

from nanovllm_tp import envs
from nanovllm_tp.config.engine_config import add_engine_args
from nanovllm_tp.launch.engine_server import engine_threads, serve_engine, serve_plans
from nanovllm_tp.launch.generate import local_model, refuse_bad_engine_args
from nanovllm_tp.launch.help_format import HelpFormatter
from nanovllm_tp.serving.replica_roles import replica_roles
from nanovllm_tp.serving.server_config import add_server_args, lora_modules, server_config
from nanovllm_tp.utils.proctitle import PREFIX, rank_title, set_title

GOMP_SPINCOUNT = "10000"      # libgomp's spins before an idle thread sleeps (see the docstring)


USAGE = "%(prog)s [MODEL] [options]"
DESCRIPTION = """\
Serve MODEL over an OpenAI-compatible HTTP API: /v1/completions,
/v1/chat/completions, /v1/responses, /v1/embeddings, /v1/models, /health,
/metrics; on 127.0.0.1:8000 unless --host and --port say otherwise.

MODEL: a Hugging Face directory, a .gguf file (or a directory holding one),
or a hub id (org/name, org/name:Q4_K_M), as vLLM takes it; the same as
--model. Without it: the embedded tiny checkpoint (random weights).

examples:
  nanovllm-tp serve HuggingFaceTB/SmolLM2-135M-Instruct
  nanovllm-tp serve DIR --port 8000 --api-key KEY
  nanovllm-tp serve DIR -tp 2        # tensor parallel over 2 ranks
  nanovllm-tp serve DIR -dp 2        # 2 replicas behind one endpoint
"""
EPILOG = """\
Every engine flag is also an LLM(...) keyword: docs/knobs.md. Routes, request
fields and limits: docs/serving.md. Under torchrun, run the module form:
  ./torchrun.sh 2 -m nanovllm_tp.launch.serve --tp 2 --model DIR
SIGTERM or Ctrl-C stops the server between two steps.
"""


def model_first(argv: list[str]) -> list[str]:
    """`serve MODEL ...` as `serve --model MODEL ...` (vLLM's form): the model is then one flag wherever the
    command line is passed on (replicas get it again with --model, and the last --model wins)."""
    return ["--model", argv[0], *argv[1:]] if argv and not argv[0].startswith("-") else list(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(usage=USAGE, description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=HelpFormatter)
    parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                        help="the model to serve, as --model (default: the embedded tiny checkpoint)")
    add_engine_args(parser)
    add_server_args(parser)
    # a data-parallel replica's own process (serving/replica_processes.py starts it): index and sockets, and the
    # file where it writes why it could not start
    parser.add_argument("--replica", help=argparse.SUPPRESS)
    parser.add_argument("--replica-report", help=argparse.SUPPRESS)
    parser.add_argument("--replica-ready", help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> None:
    argv = model_first(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None:
            parser.error(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    try:
        server = server_config(args)
        if server.data_parallel_size > 1 and args.pipeline_parallel_size > 1:
            raise ValueError("--data-parallel-size with --pipeline-parallel-size is not implemented yet: run "
                             "pipeline-parallel replicas as separate servers")
        replica_roles(server.replica_roles, server.data_parallel_size)
        loras = lora_modules(server)
        if (loras or server.allow_runtime_lora_updating) and not args.enable_lora:
            raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    except (ValueError, TypeError) as exc:
        print(f"serve: {exc}", file=sys.stderr)
        sys.exit(2)
    server.api_key = server.api_key or envs.get("NANOVLLM_TP_API_KEY") or None
    if args.device != "cuda":            # before torch loads libgomp (a GPU rank hardly runs OpenMP regions)
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    from nanovllm_tp.distributed.launch import launched_by_torchrun
    # the command's own process refuses what the config decides before any rank, replica or HTTP process starts;
    # a replica was checked by its supervisor, and a torchrun replica reports its failure to rank 0 itself
    if args.replica is None and not (server.data_parallel_size > 1 and launched_by_torchrun()):
        refuse_bad_engine_args("serve", args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from nanovllm_tp.launch import serve_replicas
    if args.replica is not None:
        serve_replicas.serve_replica(args, server, loras)
    elif server.data_parallel_size > 1 and launched_by_torchrun():
        serve_replicas.serve_torchrun_rank(args, server, loras)
    elif server.data_parallel_size > 1:
        # the replicas load what this process resolved (a hub id's snapshot, fetched once, here), never the hub
        # themselves: the last --model of a command line wins
        serve_replicas.serve_replicas(args, server, [*argv, "--model", local_model(args)] if args.model else argv)
    elif int(os.environ.get("RANK", "0")) != 0:
        engine_threads(args)
        set_title(rank_title(int(os.environ["RANK"])))
        serve_plans(args)          # under torchrun, ranks > 0 serve plans in here and exit with rank 0
    else:
        set_title(f"{PREFIX}::serve" if not launched_by_torchrun() else rank_title(0))
        serve_engine(args, server, loras, engine_threads(args))


if __name__ == "__main__":
    main()
