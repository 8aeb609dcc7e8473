"""The linear kernels chosen per weight shape and row-count bucket (packed_linear="auto") against each forced path,
in one run.

    python -m nanovllm_tp.bench.kernels --model DIR --dtype bfloat16 --repeats 3
    python -m nanovllm_tp.bench.kernels --model DIR --dtype bfloat16 --fresh --modes auto c onednn
    python -m nanovllm_tp.bench.kernels --one-row Q4_K Q6_K Q4_0 Q8_0 Q5_K --threads 2

--one-row TYPE... measures no engine: one row (a decode step's matmul) through csrc/linear_q.c for each GGUF type
given, and through csrc/linear.c's bf16 kernel, over random weights of the Llama-3.2-1B shapes (3072 x 2048,
2048 x 2048, 16384 x 2048, 2048 x 8192, repeated to ONE_ROW_BYTES, ten times the last-level cache: read from
memory as in a step), GB/s of the weights as held, best and median of --repeats passes, beside the machine's read
rate (bench/bandwidth.py) and its share of it: each pass is followed by one read of the read rate's buffer, and
the share is the median of the passes' (kernel GB/s) / (that read's GB/s), since this kind of machine's rate moves
by tens of percent within seconds. A kernel above every read of the run means the read rate is measured low.

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
ONE_ROW_SHAPES = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))     # Llama-3.2-1B's (n, k)
ONE_ROW_BYTES = 320 << 20


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
    parser.add_argument("--one-row", nargs="+", metavar="TYPE", help="only the one-row GB/s of these GGUF types "
                        "(Q4_K, Q6_K, ...) and of bf16, against the read rate; no engine")
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


def random_raw_blocks(n: int, k: int, qtype: int, rng):
    """n rows of random valid GGUF blocks of qtype as the file stores them ([n, bytes] uint8): random quants, fp16
    scales (and mins) of a sane size."""
    import numpy as np
    import torch

    from nanovllm_tp.layers.quant import BLOCK_BYTES, BLOCK_SIZE
    raw = rng.integers(0, 256, (n * (k // BLOCK_SIZE[qtype]), BLOCK_BYTES[qtype]), dtype=np.uint8)

    def half(lo, hi):
        return rng.uniform(lo, hi, raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == 14:                     # Q6_K: d last
        raw[:, -2:] = half(-0.004, 0.004)
    else:
        raw[:, 0:2] = half(-0.01, 0.01)
        if qtype in (3, 7, 12, 13):     # a min (dmin) beside d
            raw[:, 2:4] = half(-0.003, 0.01)
    return torch.from_numpy(raw.reshape(n, -1))


def one_row_rates(types: list[str], threads: int, repeats: int) -> dict:
    """{kind: {"gb_s": best, "median_gb_s", "bytes", "share", "read_gb_s"}} for each GGUF type and "bf16": one row
    through the layer's C kernel over ONE_ROW_BYTES of 1B-shaped weights, called back to back as a step calls
    them; each pass followed by one read of the read rate's buffer (bandwidth.read_sampler): "share" is the
    median over the passes of (the pass's GB/s) / (the read's), "read_gb_s" the best read (None without the C
    read)."""
    import statistics

    import numpy as np
    import torch

    from nanovllm_tp.layers import cpu_kernels
    from nanovllm_tp.layers.quant import GGUF_TYPES, QuantBlocks, QuantWeight, pack_blocks
    from nanovllm_tp.bench.bandwidth import read_sampler
    kernels = cpu_kernels.load()
    sample_read = read_sampler(threads)
    codes = {name: code for code, name in GGUF_TYPES.items()}
    rng, out = np.random.default_rng(0), {}
    for kind in [*types, "bf16"]:
        if kind != "bf16" and (kind not in codes or kernels is None or codes[kind] not in kernels.quant_types):
            continue
        if kind == "bf16" and (kernels is None or torch.bfloat16 not in kernels.linear_dtypes):
            continue
        weights, total = [], 0
        while total < ONE_ROW_BYTES:
            for n, k in ONE_ROW_SHAPES:
                if kind == "bf16":
                    packed = kernels.pack_linear_weight((torch.randn(n, k) * 0.02).to(torch.bfloat16))
                else:
                    packed = pack_blocks(QuantBlocks(random_raw_blocks(n, k, codes[kind], rng), codes[kind], k))
                    assert isinstance(packed, QuantWeight)
                weights.append((packed, n, k))
                total += (packed if kind == "bf16" else packed.data).untyped_storage().nbytes()
        xs = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in {k for _, k in ONE_ROW_SHAPES}}

        def step():
            for packed, n, k in weights:
                if kind == "bf16":
                    kernels.linear(xs[k], packed, n)
                else:
                    kernels.linear_quant(xs[k], packed.data, packed.qtype, n)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            step()
            rates, reads = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                step()
                rates.append(total / (time.perf_counter() - t0) / 1e9)
                if sample_read is not None:
                    reads.append(sample_read())
        finally:
            torch.set_num_threads(before)
        out[kind] = {"gb_s": max(rates), "median_gb_s": statistics.median(rates), "bytes": total,
                     "share": statistics.median(r / b for r, b in zip(rates, reads)) if reads else None,
                     "read_gb_s": max(reads) if reads else None}
        del weights
    return out


def one_row_main(args) -> dict:
    from nanovllm_tp.bench.bandwidth import read_bandwidth
    import torch
    from nanovllm_tp.layers.quant import GGUF_TYPES
    unknown = sorted(set(args.one_row) - set(GGUF_TYPES.values()))
    if unknown:
        raise SystemExit(f"--one-row takes GGUF types ({', '.join(sorted(GGUF_TYPES.values()))}), got {unknown}")
    env = bc.environment()
    threads = torch.get_num_threads()
    rates = one_row_rates(args.one_row, threads, args.repeats)
    read = read_bandwidth(threads)
    best_read = max([read["gb_s"], *(r["read_gb_s"] for r in rates.values() if r["read_gb_s"])])
    rows = [[kind, f"{r['gb_s']:.1f}", f"{r['median_gb_s']:.1f}", "-" if r["share"] is None else f"{r['share']:.0%}",
             "-" if r["read_gb_s"] is None else f"{r['read_gb_s']:.1f}", f"{r['gb_s'] / best_read:.0%}"]
            for kind, r in rates.items()]
    title = (f"{NAME} one row: {threads} threads, {ONE_ROW_BYTES >> 20} MiB of Llama-3.2-1B-shaped weights a pass, "
             f"best / median of {args.repeats}, each pass followed by one read of the read rate's buffer; read rate "
             f"{read['gb_s']:.1f} GB/s at the start ({read['how']}), best of the run {best_read:.1f}")
    table = bc.format_table(["weights", "best GB/s", "median GB/s", "paired share of the read rate",
                             "best read beside it", "best / best read of the run"], rows, title)
    over = [kind for kind, r in rates.items() if r["gb_s"] > best_read]
    if over:
        table += f"\n{', '.join(over)} read faster than any read of the run: the read rate is measured low"
    return bc.finish(args, NAME, env, table, one_row=rates, read_rate=read)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    bc.apply_threads(args)
    if args.one_row:
        return one_row_main(args)
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
