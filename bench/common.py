"""Shared pieces of the benchmark scripts (bench, bench_latency, bench_tp, ...): their common flags (workload,
threads, output), the model to benchmark (--model, or the embedded tiny checkpoint / the "small" preset) and
transformers kept quiet. The scripts reach every shared piece as `bench_common.X`: the workload
(workload.py), the environment record (env.py) and the statistics, JSON, table and plot
(report.py) are re-exported here.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib

from nanovllm_tp.bench.env import environment, finish_environment
from nanovllm_tp.bench.report import (default_out_path, fmt, format_table, log, median, percentile, plot_path,
                                      save_plot, save_result, say_written, summarize, write_json)
from nanovllm_tp.bench.workload import MAX_TOKEN_ID, Workload, make_workload, shared_prefix_prompts, warmup_prompts

__all__ = ["environment", "finish_environment", "default_out_path", "fmt", "format_table", "log", "median",
           "percentile", "plot_path", "save_plot", "save_result", "say_written", "summarize", "write_json", "MAX_TOKEN_ID",
           "Workload", "make_workload", "shared_prefix_prompts", "warmup_prompts", "add_workload_args",
           "add_paired_workload_args", "apply_threads", "add_output_args", "out_path", "finish", "resolve_model", "model_vocab_size", "config_dict",
           "quiet_transformers"]


def add_workload_args(parser: argparse.ArgumentParser, *, num_requests=64, prompt_len=(16, 256),
                      output_len=(16, 256)) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=num_requests)
    g.add_argument("--prompt-len", type=int, nargs=2, default=list(prompt_len), metavar=("LO", "HI"),
                   help="prompt lengths, uniform in [LO, HI] (default: %(default)s)")
    g.add_argument("--output-len", type=int, nargs=2, default=list(output_len), metavar=("LO", "HI"),
                   help="output lengths, uniform in [LO, HI] (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--preset", choices=["tiny", "small"], default="tiny",
                   help="random-weight checkpoint to use when --model is not given (made once, cached)")
    parser.add_argument("--threads", type=int,
                        help="CPU threads per process (sets OMP_NUM_THREADS for spawned ranks and torch's thread "
                             "count here; default: torch's default, or OMP_NUM_THREADS)")


def add_paired_workload_args(parser: argparse.ArgumentParser, *, max_tokens: int):
    """The workload flags of the benchmarks that pair two runs of one workload (bench_spec, bench_struct): output
    length, temperature, repeats, the random checkpoint, threads. Returns the group, for the benchmark's own."""
    g = parser.add_argument_group("workload")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--repeats", type=int, default=3)
    g.add_argument("--preset", choices=["tiny", "small"], default="tiny",
                   help="random-weight checkpoint to use when --model is not given")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    return g


def apply_threads(args) -> None:
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {args.threads}")
        import torch
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)


def add_output_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("output")
    g.add_argument("--out", help="JSON result path (default: results/<name>-<timestamp>.json under the working "
                                 "directory; the path is printed on stderr)")
    g.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                   help="also write a PNG (default path: the JSON path with .png); needs matplotlib")
    g.add_argument("--quiet", action="store_true", help="only the final table")


def out_path(args, name: str) -> pathlib.Path:
    """Where the JSON result goes: --out, else results/<name>-<timestamp>.json."""
    return pathlib.Path(args.out) if args.out else default_out_path(name)


def finish(args, name: str, env: dict, table: str, **fields) -> dict:
    """The result of a table-printing benchmark: name, config, environment, fields and the table, written as JSON
    (out_path), then the table on stdout."""
    result = {"name": name, "config": config_dict(args), "environment": finish_environment(env), **fields,
              "table": table}
    say_written(write_json(out_path(args, name), result))
    print(table, flush=True)
    return result


def resolve_model(args) -> str:
    """--model, else the cached random-weight checkpoint of --preset (made on first use)."""
    if args.model:
        return args.model
    from nanovllm_tp.launch.make_tiny import ensure_tiny
    return str(ensure_tiny(args.preset))


def model_vocab_size(model: str) -> int:
    """The vocabulary of a HF directory (its config.json), or of a .gguf file as the engine reads it."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        from nanovllm_tp.config.model_config import ModelConfig
        return ModelConfig.from_pretrained(model).vocab_size
    with open(path) as f:
        config = json.load(f)
    return int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])


def config_dict(args) -> dict:
    return {k: v for k, v in sorted(vars(args).items()) if not k.startswith("_")}


def quiet_transformers() -> None:
    """No weight-loading progress bars, and no 'install psutil' errors from continuous batching on CPU."""
    import logging
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    except (ImportError, AttributeError):
        pass      # an older transformers: the bars stay

    class _NoPsutil(logging.Filter):
        def filter(self, record):
            return "psutil" not in record.getMessage()

    logger = logging.getLogger("ContinuousBatchingLogger")
    if not any(type(f).__name__ == "_NoPsutil" for f in logger.filters):
        logger.addFilter(_NoPsutil())


def sse_events(lines):
    """The events of a server-sent stream's lines (an OpenAI streamed response): each `data:` line's JSON, and the
    string "[DONE]" for the last."""
    import json
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)
