"""Shared pieces of the benchmark scripts (bench, bench_latency, bench_tp).

Workload: nano-vllm's bench.py shape. N requests; each prompt is random token ids and its length, like its
output length, is uniform in an inclusive range; every request runs with ignore_eos, so it produces exactly the
requested number of tokens. Lengths and ids come from one seeded generator, so a seed fixes the workload.

Also here: the model to benchmark (--model, or the embedded tiny checkpoint / the "small" preset), the
environment record, JSON writing, a plain-text table and an optional matplotlib plot.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import random
import socket
import statistics
import subprocess
import sys
from dataclasses import dataclass

MAX_TOKEN_ID = 10000          # nano-vllm draws prompt ids from [0, 10000]; smaller vocabs are clamped


# =============================================================================================== workload

@dataclass
class Workload:
    prompt_lens: list[int]
    output_lens: list[int]
    seed: int
    vocab_size: int

    @property
    def num_requests(self) -> int:
        return len(self.prompt_lens)

    @property
    def requested_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    def prompts(self, draw: int = 0) -> list[list[int]]:
        """The prompts' token ids. `draw` > 0 redraws the ids (same lengths): the compute is the same, but a
        repeat cannot hit the prefix cache filled by the previous one. Every engine gets the same draw."""
        rng = random.Random(f"{self.seed}/tokens/{draw}")
        hi = min(MAX_TOKEN_ID, self.vocab_size - 1)
        return [[rng.randint(0, hi) for _ in range(n)] for n in self.prompt_lens]

    def describe(self) -> dict:
        return {"num_requests": self.num_requests, "seed": self.seed, "vocab_size": self.vocab_size,
                "prompt_tokens": self.prompt_tokens, "requested_output_tokens": self.requested_output_tokens,
                "prompt_len_min": min(self.prompt_lens), "prompt_len_max": max(self.prompt_lens),
                "output_len_min": min(self.output_lens), "output_len_max": max(self.output_lens),
                "token_ids": "uniform in [0, min(10000, vocab-1)]; redrawn (same lengths) for every repeat so the "
                             "prefix cache cannot hit across repeats; all engines get the same draw"}


def make_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int,
                  vocab_size: int) -> Workload:
    for name, (lo, hi) in (("prompt-len", prompt_len), ("output-len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"--{name} needs 1 <= LO <= HI, got {lo} {hi}")
    if num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {num_requests}")
    rng = random.Random(f"{seed}/lengths")
    prompt_lens = [rng.randint(*prompt_len) for _ in range(num_requests)]
    output_lens = [rng.randint(*output_len) for _ in range(num_requests)]
    return Workload(prompt_lens, output_lens, seed, vocab_size)


def warmup_prompts(vocab_size: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """A small warm-up set: a few short requests and one longer prompt (prefill and decode paths, allocator)."""
    rng = random.Random(f"{seed}/warmup")
    hi = min(MAX_TOKEN_ID, vocab_size - 1)
    lens = [8, 16, 24, 96]
    return [[rng.randint(0, hi) for _ in range(n)] for n in lens], [8, 8, 8, 4]


# =============================================================================================== arguments

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
    g.add_argument("--out", help="JSON result path (default: results/<name>-<timestamp>.json)")
    g.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                   help="also write a PNG (default path: the JSON path with .png); needs matplotlib")
    g.add_argument("--quiet", action="store_true", help="only the final table")


def resolve_model(args) -> str:
    """--model, else the cached random-weight checkpoint of --preset (made on first use)."""
    if args.model:
        return args.model
    from nanovllm_tp.launch.make_tiny import ensure_tiny
    return str(ensure_tiny(args.preset))


def model_vocab_size(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    return int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])


def config_dict(args) -> dict:
    return {k: v for k, v in sorted(vars(args).items()) if not k.startswith("_")}


# =============================================================================================== environment

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=False)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=False)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    import torch
    env = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "cuda": torch.cuda.is_available(),
        "git_commit": _git_commit(),
        "launched_by": "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ else "python",
        "argv": sys.argv,
    }
    from importlib.metadata import PackageNotFoundError, version
    for module in ("transformers", "nanovllm_tp", "triton", "flash_attn"):
        try:
            env[module] = version("nanovllm-tp" if module == "nanovllm_tp" else module)
        except PackageNotFoundError:
            env[module] = None
    if env["cuda"]:
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def finish_environment(env: dict) -> dict:
    if hasattr(os, "getloadavg"):
        env["loadavg_at_end"] = list(os.getloadavg())
    return env


# =============================================================================================== statistics

def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(xs: list[float]) -> dict:
    """mean, p50, p90, p99 (plus min/max/count) of a list; None fields when it is empty."""
    xs = [x for x in xs if x is not None]
    return {"count": len(xs), "mean": statistics.fmean(xs) if xs else None, "p50": percentile(xs, 50),
            "p90": percentile(xs, 90), "p99": percentile(xs, 99), "min": min(xs) if xs else None,
            "max": max(xs) if xs else None}


# =============================================================================================== output

def default_out_path(name: str) -> pathlib.Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return pathlib.Path("results") / f"{name}-{stamp}.json"


def write_json(path, data: dict) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def fmt(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isinf(x) or math.isnan(x):
            return str(x)
        return f"{x:,.{digits}f}"
    return str(x)


def format_table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row):   # first column left-aligned (labels), the rest right-aligned (numbers)
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    rule = "-" * len(line(cells[0]))
    out = ([title] if title else []) + [rule, line(cells[0]), rule] + [line(r) for r in cells[1:]] + [rule]
    return "\n".join(out)


def plot_path(args, out_path: pathlib.Path) -> pathlib.Path | None:
    if args.plot is None:
        return None
    return pathlib.Path(args.plot) if args.plot else out_path.with_suffix(".png")


def save_plot(path: pathlib.Path | None, draw) -> str | None:
    """Call draw(plt) and save the figure to `path`; returns the path, or None (with a message) without
    matplotlib. The figure is made with the Agg backend, so no display is needed."""
    if path is None:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed, no plot written "
              "(pip install matplotlib, or pip install -e '.[plot]')", file=sys.stderr)
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = draw(plt)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def save_result(args, out_path: pathlib.Path, result: dict, draw) -> dict:
    """The PNG (with --plot), then the JSON; result gains "plot" and "out"."""
    png = save_plot(plot_path(args, out_path), draw(result))
    if png:
        result["plot"] = png
    write_json(out_path, result)
    result["out"] = str(out_path)
    log(args, f"wrote {out_path}" + (f" and {png}" if png else ""))
    return result


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


def log(args, msg: str) -> None:
    if not getattr(args, "quiet", False):
        print(msg, file=sys.stderr, flush=True)
