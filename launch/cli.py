"""`nanovllm-tp`: one command, a subcommand per job (as `vllm serve`, `vllm bench`).

    nanovllm-tp serve MODEL --port 8000            # the OpenAI server (MODEL: HF directory, .gguf, or dir with one)
    nanovllm-tp generate --model MODEL --prompt "The quick brown fox"
    nanovllm-tp bench [KIND] [flags]               # KIND: throughput (default), latency, serve, tp, kernels, ...
    nanovllm-tp convert FILE.gguf OUT_DIR          # a GGUF file as a plain HF directory
    nanovllm-tp --version

Each subcommand but bench is the module `python -m nanovllm_tp.launch.<module>` (COMMANDS: the subcommand's name
with `_` for `-`) with the same flags; `bench KIND` is `python -m nanovllm_tp.bench KIND`, one of BENCHES' modules.
`nanovllm-tp SUBCOMMAND --help` prints the flags. Under torchrun, run the module form
(`./torchrun.sh 2 -m nanovllm_tp.launch.serve --tp 2 ...`).
"""
import importlib
import importlib.util
import sys

# subcommand -> (module, what it does)
COMMANDS = {
    "serve": ("nanovllm_tp.launch.serve", "the OpenAI-compatible HTTP server (MODEL positional or --model)"),
    "generate": ("nanovllm_tp.launch.generate", "print completions for prompts"),
    "bench": (None, "benchmarks: nanovllm-tp bench KIND --help"),
    "convert": ("nanovllm_tp.launch.convert", "a .gguf file as a plain HF directory"),
    "perplexity": ("nanovllm_tp.launch.perplexity", "perplexity of a text through the engine"),
    "make-tiny": ("nanovllm_tp.launch.make_tiny", "an offline random-weight checkpoint (tests, benchmarks)"),
    "make-shape": ("nanovllm_tp.launch.make_shape", "a random-weight checkpoint of a real model's shape (1B-8B)"),
    "make-lora": ("nanovllm_tp.launch.make_lora", "random PEFT adapters for a checkpoint"),
    "soak": ("nanovllm_tp.launch.soak", "the seeded lifecycle soak against a reference engine"),
    "gpu-check": ("nanovllm_tp.launch.gpu_check", "the one-command GPU check (exactness, throughput)"),
}

# bench KIND -> (module, what it measures)
BENCHES = {
    "throughput": ("nanovllm_tp.bench.throughput", "offline throughput; --compare hf | vllm | llamacpp | openvino"),
    "latency": ("nanovllm_tp.bench.latency", "time to first token and per output token"),
    "serve": ("nanovllm_tp.bench.serve", "the HTTP server under concurrent streams"),
    "tp": ("nanovllm_tp.bench.tp", "tensor- and pipeline-parallel layouts (micro-batches, stage overlap)"),
    "stage-overlap": ("nanovllm_tp.bench.stage_overlap", "pipeline stages busy at once, from an engine trace"),
    "router-sim": ("nanovllm_tp.bench.router_sim", "router policies on the shared-prefix workload, modelled time"),
    "kernels": ("nanovllm_tp.bench.kernels", "the linear kernel table against each forced kernel"),
    "kv": ("nanovllm_tp.bench.kv", "KV cache formats side by side"),
    "quant": ("nanovllm_tp.bench.quant", "a GGUF file quantized against dequantized"),
    "spec": ("nanovllm_tp.bench.spec", "speculative decoding against plain decoding"),
    "struct": ("nanovllm_tp.bench.structured", "structured outputs against free text"),
    "json": ("nanovllm_tp.bench.json_validity", "how often JSON-schema answers end valid, per object rule"),
    "struct-validity": ("nanovllm_tp.bench.struct_validity", "structured answers valid, against any OpenAI server"),
    "lora": ("nanovllm_tp.bench.lora", "requests with LoRA adapters against the base model"),
    "embed": ("nanovllm_tp.bench.embed", "embeddings throughput"),
    "attention": ("nanovllm_tp.bench.attention", "the paged decode attention kernel alone"),
    "prompt-attention": ("nanovllm_tp.bench.prompt_attention", "a prompt's attention: SDPA against decode rows"),
    "step": ("nanovllm_tp.bench.step", "one step's cost and the plan broadcast"),
    "limits": ("nanovllm_tp.bench.limits", "what hostile clients cost the server"),
    "chaos": ("nanovllm_tp.bench.chaos", "ranks of data-parallel replicas killed under load"),
    "disagg": ("nanovllm_tp.bench.disagg", "disaggregated prefill/decode against colocated replicas; the KV transfer"),
    "restart": ("nanovllm_tp.bench.restart", "a rolling restart under load: streams moved with their KV, or computed again"),
    "threads": ("nanovllm_tp.bench.threads", "the default CPU thread count against fixed ones, quiet and busy"),
}


# bench KIND -> the packages it imports beyond the package's own requirements: all in the [bench] extra (setup.cfg),
# checked before the benchmark starts
BENCH_NEEDS = {
    "serve": ("aiohttp", "httpx"),
    "chaos": ("httpx",),
    "disagg": ("httpx",),
    "restart": ("httpx",),
    "limits": ("httpx",),
    "json": ("jsonschema",),
    "struct-validity": ("openai", "jsonschema"),
    "lora": ("peft",),
}


def version() -> str:
    from nanovllm_tp import __version__
    return __version__


def _usage(table: dict, head: str) -> str:
    width = max(map(len, table))
    return head + "\n" + "\n".join(f"  {name.ljust(width)}  {what}" for name, (_, what) in table.items())


def missing_packages(kind: str) -> list[str]:
    """The packages bench KIND needs (BENCH_NEEDS) that this environment cannot import."""
    return [name for name in BENCH_NEEDS.get(kind, ()) if importlib.util.find_spec(name) is None]


def _run(module: str, argv: list[str], prog: str) -> int:
    sys.argv[0] = prog           # argparse's usage line names the command the user typed
    result = importlib.import_module(module).main(argv)
    return result if isinstance(result, int) else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(COMMANDS, "usage: nanovllm-tp {--version | SUBCOMMAND [flags]}\n\nsubcommands:")
              + "\n\nnanovllm-tp SUBCOMMAND --help: its flags. Module forms, same flags:\n"
                "  python -m nanovllm_tp.launch.<module>   the subcommand's name, _ for - (make_shape)\n"
                "  python -m nanovllm_tp.bench KIND        nanovllm-tp bench KIND")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name in ("-V", "--version"):
        print(f"nanovllm-tp {version()}")
        return 0
    if name not in COMMANDS:
        print(f"nanovllm-tp: unknown subcommand {name!r}\n\n" + _usage(COMMANDS, "subcommands:"), file=sys.stderr)
        return 2
    if name == "bench":
        kind = rest[0] if rest and not rest[0].startswith("-") else "throughput"
        if rest and rest[0] in ("-h", "--help") and len(rest) == 1:
            print(_usage(BENCHES, "usage: nanovllm-tp bench [KIND] [flags]   (KIND --help: its flags)\n\nkinds:")
                  + "\n\nSome kinds need the [bench] extra: pip install 'nanovllm-tp[bench]'.\n"
                    "A kind that keeps its result writes it to results/<name>-<timestamp>.json under\n"
                    "the working directory (--out PATH: there instead) and prints its path on stderr.")
            return 0
        if kind not in BENCHES:
            print(f"nanovllm-tp bench: unknown kind {kind!r}\n\n" + _usage(BENCHES, "kinds:"), file=sys.stderr)
            return 2
        rest = rest[1:] if rest and rest[0] == kind else rest
        missing = missing_packages(kind)
        if missing and not {"-h", "--help"} & set(rest):
            print(f"nanovllm-tp bench {kind}: needs {', '.join(missing)}: pip install 'nanovllm-tp[bench]'",
                  file=sys.stderr)
            return 2
        return _run(BENCHES[kind][0], rest, f"nanovllm-tp bench {kind}")
    if name in ("serve", "generate") and rest and not rest[0].startswith("-"):
        rest = ["--model", rest[0], *rest[1:]]      # `serve MODEL`, as `vllm serve MODEL`
    return _run(COMMANDS[name][0], rest, f"nanovllm-tp {name}")


if __name__ == "__main__":
    sys.exit(main())
