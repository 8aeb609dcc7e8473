"""The linear kernels chosen per weight shape and row-count bucket (packed_linear="auto") against each forced path,
in one run.

    python -m nanovllm_tp.bench.kernels --model DIR --dtype bfloat16 --repeats 3
    python -m nanovllm_tp.bench.kernels --model DIR --dtype bfloat16 --fresh --modes auto c onednn

One engine per --modes entry (the packed_linear knob), built in this process with the other engine flags as
given; --fresh first deletes this CPU's cached table for the dtype, so that the auto engine measures it at load
(the time is printed). Two workloads, random prompt ids, ignore_eos, greedy: `batch`, bench's (--num-requests,
default 32, prompt and output lengths uniform in --prompt-len / --output-len, default 16..256), and `one`, one
request (--one-prompt-len, --one-tokens); output tokens / wall time of one generate() call each. Each repeat runs
every engine on both workloads, the engines interleaved, with fresh prompt ids; medians over the repeats, each
figure's ratio to the first mode's. Then the auto engine's table: per shape and bucket the winner and every
candidate's median microseconds per call at the bucket's timed row count.
"""
from __future__ import annotations

import argparse
import os
import time

from nanovllm_tp.bench import common as bc
from nanovllm_tp.bench.engine import run_engine, summarize_runs, warm_up_engine
from nanovllm_tp.config.engine_config import add_engine_args, engine_kwargs

NAME = "bench_kernels"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    bc.add_workload_args(parser, num_requests=32)
    parser.add_argument("--modes", nargs="+", default=["auto", "c", "onednn"],
                        choices=["auto", "c+onednn", "c", "bf16", "onednn", "off"], help="packed_linear values compared")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fresh", action="store_true", help="measure the kernel table anew (delete the cached one)")
    parser.add_argument("--one-prompt-len", type=int, default=128)
    parser.add_argument("--one-tokens", type=int, default=128)
    bc.add_output_args(parser)
    return parser


def kernel_rows(report: dict | None) -> tuple[list[str], list[list]]:
    """The auto engine's table as printed: shape, bucket, winner, then µs per call of each candidate timed."""
    if not report:
        return ["shape", "bucket", "winner"], []
    names = sorted({c for row in report["table"] for c in row["us"]})
    rows = [[f"{row['dtype']} {row['shape']}", row["bucket"], row["winner"], *(row["us"].get(c, "-") for c in names)]
            for row in report["table"]]
    return ["shape", "bucket", "winner", *(f"{c} us" for c in names)], rows


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    bc.apply_threads(args)
    args.model = bc.resolve_model(args)
    vocab = bc.model_vocab_size(args.model)
    batch = bc.make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.seed, vocab)
    one = bc.make_workload(1, (args.one_prompt_len,) * 2, (args.one_tokens,) * 2, args.seed, vocab)
    from nanovllm_tp import LLM
    env, llms, runs, built = bc.environment(), {}, {}, {}
    try:
        for mode in args.modes:
            kwargs = {**engine_kwargs(args), "packed_linear": mode}
            if mode == "auto" and args.fresh:
                import torch
                from nanovllm_tp.layers import kernel_choice, packed_linear  # noqa: F401  (its kernels register)
                dtype = {"auto": torch.float32}.get(args.dtype) or getattr(torch, args.dtype)
                kernel_choice.cache_path(dtype).unlink(missing_ok=True)
            t0 = time.perf_counter()
            llms[mode] = LLM(**kwargs)
            built[mode] = time.perf_counter() - t0
            bc.log(args, f"{mode}: built in {built[mode]:.1f}s: {llms[mode].engine.runner.describe()}")
            warm_up_engine(llms[mode], vocab, args.seed, 0.0)
        for r in range(args.repeats):
            prompts = {"batch": batch.prompts(draw=r + 1), "one": one.prompts(draw=r + 1)}
            for mode, llm in llms.items():
                for name, workload in (("batch", batch), ("one", one)):
                    run = run_engine(llm, workload, prompts[name], 0.0)
                    runs.setdefault(mode, {}).setdefault(name, []).append(run)
                    bc.log(args, f"[{r + 1}/{args.repeats}] {mode} {name}: {run['tok_s']:.1f} tok/s")
        report = llms["auto"].stats()["linear_kernels"] if "auto" in llms else None
    finally:
        for llm in llms.values():
            llm.close()
    figures = {mode: {name: summarize_runs(rs) for name, rs in per.items()} | {"build_s": built[mode]}
               for mode, per in runs.items()}
    first = figures[args.modes[0]]
    rows = [[mode] + [x for name in ("batch", "one") for x in
                      (f[name]["tok_s"], f"{f[name]['tok_s'] / first[name]['tok_s']:.2f}x")] + [f"{f['build_s']:.1f}"]
            for mode, f in figures.items()]
    title = (f"{NAME}: {os.path.basename(args.model.rstrip('/'))} {args.dtype}, median of {args.repeats}, torch "
             f"threads {env['torch_threads']}; batch: {batch.num_requests} requests, prompt {args.prompt_len[0]}.."
             f"{args.prompt_len[1]}, output {args.output_len[0]}..{args.output_len[1]}; one: {args.one_prompt_len} "
             f"-> {args.one_tokens}; ratio = this / {args.modes[0]}")
    table = bc.format_table(["packed_linear", "batch tok/s", "ratio", "one tok/s", "ratio", "build s"], rows, title)
    headers, krows = kernel_rows(report)
    if krows:
        table += "\n\n" + bc.format_table(headers, krows, f"auto's kernels per bucket ({report['summary']}; "
                                                           f"amx {report['amx']}, cached {report['cached']})")
    return bc.finish(args, NAME, env, table, workloads={"batch": batch.describe(), "one": one.describe()},
                     figures=figures, linear_kernels=report)


if __name__ == "__main__":
    main()
