"""Weights that stay quantized against the same model dequantized, and optionally llama.cpp, on one model.

    python -m nanovllm_tp.bench.quant --model FILE.gguf --repeats 5
    python -m nanovllm_tp.bench.quant --model FILE.gguf --llama-cpp DIR   # DIR: llama-bench, llama-batched-bench
    python -m nanovllm_tp.bench.quant --model HF_DIR --engines int8:bfloat16 none:bfloat16

Engines (`--engines`, each QUANTIZATION:DTYPE, optionally :KNOB=VALUE,... for other knobs of that engine alone,
such as auto:float32:fused_decode=false) are built in this process on the same file, with the other engine
flags as given: by default `auto:bfloat16` (the file's Q8_0/Q4_0/Q4_1 tensors stay quantized) and `none:bfloat16`
(dequantized at load into bf16). Two workloads, random prompt ids, ignore_eos, greedy:

  one stream  one request, a --stream-prompt-len prompt and --stream-tokens tokens: decode tok/s = 1 / TPOT (the
              first token, which comes with the prompt, is left out), what llama-bench's tg test counts;
  batch       --batch requests of --batch-prompt-len prompt and --batch-tokens output tokens at once: total
              tok/s = (prompt + output tokens) / wall time, llama-batched-bench's S, and output tok/s.

Each repeat runs every engine on the --workloads (both by default), one after the other, then llama.cpp's
`llama-bench -p 0 -n N` and `llama-batched-bench -npp P -ntg N -npl B` with --threads threads when --llama-cpp is
given (an outside build; nothing here depends on it). Medians over the repeats, and each figure's ratio to the
first engine's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

from nanovllm_tp.bench import common as bc
from nanovllm_tp.config.engine_config import add_engine_args, engine_kwargs

NAME = "bench_quant"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--engines", nargs="+", default=["auto:bfloat16", "none:bfloat16"],
                        metavar="QUANTIZATION:DTYPE[:KNOB=VALUE,...]", help="engines to compare (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", choices=["stream", "batch"], default=["stream", "batch"])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="CPU threads, for the engines and llama.cpp alike (default: the usable cores)")
    g = parser.add_argument_group("workloads")
    g.add_argument("--stream-prompt-len", type=int, default=16)
    g.add_argument("--stream-tokens", type=int, default=128)
    g.add_argument("--batch", type=int, default=32)
    g.add_argument("--batch-prompt-len", type=int, default=128)
    g.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--llama-cpp", metavar="DIR", help="a llama.cpp build's bin directory: run its benches too")
    bc.add_output_args(parser)
    return parser


def _knob_value(text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    return int(text) if text.lstrip("-").isdigit() else text


def engine_specs(specs: list[str]) -> list[tuple[str, str, dict]]:
    """QUANTIZATION:DTYPE[:KNOB=VALUE,...] -> (quantization, dtype, other knobs), e.g.
    auto:float32:fused_decode=false for the same engine with its decode layers run module by module."""
    out = []
    for spec in specs:
        quantization, _, rest = spec.partition(":")
        dtype, _, extra = rest.partition(":")
        pairs = [p.partition("=") for p in extra.split(",") if p]
        if not dtype or any(not eq or not name for name, eq, _ in pairs):
            raise SystemExit(f"--engines takes QUANTIZATION:DTYPE[:KNOB=VALUE,...], got {spec!r}")
        out.append((quantization, dtype, {name: _knob_value(value) for name, _, value in pairs}))
    return out


def one_stream(llm, args, draw: int) -> dict:
    from nanovllm_tp import SamplingParams
    prompt = bc.make_workload(1, (args.stream_prompt_len,) * 2, (1, 1), args.seed, args.vocab_size).prompts(draw)
    params = SamplingParams(temperature=0, max_tokens=args.stream_tokens, ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    return {"decode_tok_s": 1.0 / out.metrics.tpot, "ttft_s": out.metrics.ttft}


def batch(llm, args, draw: int) -> dict:
    from nanovllm_tp import SamplingParams
    workload = bc.make_workload(args.batch, (args.batch_prompt_len,) * 2, (1, 1), args.seed, args.vocab_size)
    prompts = workload.prompts(draw)
    params = SamplingParams(temperature=0, max_tokens=args.batch_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == args.batch_tokens for o in outs)
    tokens = args.batch * (args.batch_prompt_len + args.batch_tokens)
    return {"total_tok_s": tokens / seconds, "output_tok_s": args.batch * args.batch_tokens / seconds}


def llama_cpp(args) -> dict:
    """llama-bench's tg test and llama-batched-bench's S on the same file and threads (the workloads asked for)."""
    out = {}
    if "stream" in args.workloads:
        tg = subprocess.run([os.path.join(args.llama_cpp, "llama-bench"), "-m", args.model, "-p", "0",
                             "-n", str(args.stream_tokens), "-t", str(args.threads), "-r", "1", "-o", "json"],
                            capture_output=True, text=True, check=True)
        out["decode_tok_s"] = json.loads(tg.stdout)[0]["avg_ts"]
    if "batch" in args.workloads:
        batched = subprocess.run([os.path.join(args.llama_cpp, "llama-batched-bench"), "-m", args.model,
                                  "-c", str(args.batch * (args.batch_prompt_len + args.batch_tokens)),
                                  "-npp", str(args.batch_prompt_len), "-ntg", str(args.batch_tokens),
                                  "-npl", str(args.batch), "-t", str(args.threads), "--output-format", "jsonl"],
                                 capture_output=True, text=True, check=True)
        row = json.loads([line for line in batched.stdout.splitlines() if line.startswith("{")][-1])
        out.update(total_tok_s=row["speed"], output_tok_s=row["pl"] * row["tg"] / row["t"])
    return out


def run_engine(llm, args, draw: int) -> dict:
    return {**(one_stream(llm, args, draw) if "stream" in args.workloads else {}),
            **(batch(llm, args, draw) if "batch" in args.workloads else {})}


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if not args.model:
        raise SystemExit("--model (a .gguf file or HF directory) is needed")
    if args.llama_cpp and not args.model.endswith(".gguf"):
        raise SystemExit("--llama-cpp runs on a .gguf file: give one as --model")
    bc.apply_threads(args)
    from nanovllm_tp import LLM
    from nanovllm_tp.config.engine_config import ModelConfig
    args.vocab_size = ModelConfig.from_pretrained(args.model).vocab_size
    env, names, llms, runs = bc.environment(), [], [], {}
    try:
        for quantization, dtype, knobs in engine_specs(args.engines):
            kwargs = {**engine_kwargs(args), "quantization": quantization, "dtype": dtype, **knobs}
            llm = LLM(**kwargs)
            stats = llm.stats()
            names.append(f"nanovllm_tp {stats['quantization'] if stats['quantization'] != 'none' else 'dequantized'}"
                         f" {dtype}" + "".join(f" {k}={v}" for k, v in knobs.items()))
            llms.append(llm)
            bc.log(args, f"{names[-1]}: {llm.engine.runner.describe()}")
            run_engine(llm, args, 0)      # warm-up
        if args.llama_cpp:
            names.append(f"llama.cpp ({os.path.basename(args.llama_cpp.rstrip('/'))})")
        for r in range(args.repeats):
            for name, llm in zip(names, llms):
                run = run_engine(llm, args, r + 1)
                runs.setdefault(name, []).append(run)
                bc.log(args, f"[{r + 1}/{args.repeats}] {name}: {run}")
            if args.llama_cpp:
                runs.setdefault(names[-1], []).append(llama_cpp(args))
                bc.log(args, f"[{r + 1}/{args.repeats}] {names[-1]}: {runs[names[-1]][-1]}")
    finally:
        for llm in llms:
            llm.close()
    keys = ("decode_tok_s", "total_tok_s", "output_tok_s")
    figures = {name: {k: bc.median(run.get(k) for run in rs) for k in keys} | {"runs": rs}
               for name, rs in runs.items()}
    first = figures[names[0]]
    rows = [[name] + [x for k in keys for x in (f[k], f"{first[k] / f[k]:.2f}x" if f[k] and first[k] else "-")]
            for name, f in figures.items()]
    title = (f"{NAME}: {os.path.basename(args.model)}, {args.threads} threads, median of {args.repeats}; one stream: "
             f"{args.stream_prompt_len}-token prompt, {args.stream_tokens} tokens; batch: {args.batch} x "
             f"{args.batch_prompt_len}/{args.batch_tokens}; ratio = {names[0]} / this")
    table = bc.format_table(["engine", "1-stream decode tok/s", "ratio", f"{args.batch}x total tok/s", "ratio",
                             f"{args.batch}x output tok/s", "ratio"], rows, title)
    return bc.finish(args, NAME, env, table, figures=figures)


if __name__ == "__main__":
    main()
