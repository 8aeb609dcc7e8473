"""KV cache formats against each other on one model: throughput, greedy agreement and perplexity, same run.

    python -m nanovllm_tp.bench.kv --model FILE.gguf --quantization none --dtype bfloat16 --repeats 5
    python -m nanovllm_tp.bench.kv --kv-dtypes auto int8 fp8_e4m3 --num-requests 32

One engine per --kv-dtypes entry (the first is the baseline), built in this process with the other engine flags as
given, all alive at once. Each repeat runs the workload (random prompt ids, ignore_eos, greedy by default) on every
engine in turn, in a rotating order, so load from other processes hits them alike; throughput = requested output
tokens / wall time of one generate(). Reported: medians, each engine's ratio to the baseline's median and the median
of its per-repeat ratios to the baseline (paired: the two ran in the same repeat), the median request's TPOT (time
per output token after the first: the decode steps without the prompts' prefill), and greedy agreement with the
baseline on the same prompts (requests whose tokens are all equal; tokens before the first difference, as a share
of all). --ppl-text FILE: each engine's perplexity on that text too (prompt logprobs).
"""
from __future__ import annotations

import argparse
import pathlib

from nanovllm_tp.bench import common as bc
from nanovllm_tp.bench import compare as bench_compare
from nanovllm_tp.bench.engine import run_engine, summarize_runs, warm_up_engine
from nanovllm_tp.config.engine_config import add_engine_args, engine_kwargs

NAME = "bench_kv"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    bc.add_workload_args(parser, num_requests=32)
    parser.add_argument("--kv-dtypes", nargs="+", default=["auto", "int8"], metavar="KV",
                        help="kv_cache_dtype of each engine, the first the baseline (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ppl-text", metavar="FILE", help="also each engine's perplexity on this text (its tokens "
                        "in windows of --ppl-window, every token after a window's first scored)")
    parser.add_argument("--ppl-window", type=int, default=512)
    bc.add_output_args(parser)
    return parser


def agreement(base: list[list[int]], other: list[list[int]]) -> dict:
    """Requests with identical tokens, and the tokens before each request's first difference over all tokens."""
    a = bench_compare.agreement(base, other)
    return {"identical_requests": a["identical"], "requests": a["requests"],
            "prefix_share": a["tokens_before_first_difference"] / a["tokens"]}


def perplexity(llm, path: str, window: int) -> float:
    """exp(mean negative log-likelihood) of the file's tokens, scored in windows (prompt logprobs)."""
    import math

    from nanovllm_tp import SamplingParams
    with open(path, encoding="utf-8") as f:
        ids = llm.get_tokenizer().encode(f.read())
    windows = [ids[i:i + window] for i in range(0, len(ids) - 1, window) if len(ids[i:i + window]) > 1]
    outs = llm.generate(windows, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll = [-out.prompt_logprobs[i][w[i]].logprob for out, w in zip(outs, windows) for i in range(1, len(w))]
    return math.exp(sum(nll) / len(nll))


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    bc.apply_threads(args)
    bc.quiet_transformers()
    from nanovllm_tp import LLM, SamplingParams
    model = bc.resolve_model(args)
    knobs = {k: v for k, v in engine_kwargs(args).items() if k not in ("model", "kv_cache_dtype")}
    engines = {kv: LLM(model, kv_cache_dtype=kv, **knobs) for kv in args.kv_dtypes}
    try:
        first = engines[args.kv_dtypes[0]]
        vocab = first.config.model_config.vocab_size
        workload = bc.make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.seed,
                                    vocab)
        for llm in engines.values():
            warm_up_engine(llm, vocab, args.seed, args.temperature)
        greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in workload.output_lens]
        tokens = {kv: [o.outputs[0].token_ids for o in llm.generate(workload.prompts(), greedy, use_tqdm=False)]
                  for kv, llm in engines.items()}
        runs = {kv: [] for kv in engines}
        order = list(engines)
        for r in range(args.repeats):
            prompts = workload.prompts(draw=r + 1)
            for kv in order[r % len(order):] + order[:r % len(order)]:
                runs[kv].append(run_engine(engines[kv], workload, prompts, args.temperature))
                bc.log(args, f"repeat {r + 1} {kv}: {runs[kv][-1]['tok_s']:.1f} tok/s")
        ppl = {kv: perplexity(llm, args.ppl_text, args.ppl_window) for kv, llm in engines.items()} \
            if args.ppl_text else {}
        stats = {kv: llm.stats() for kv, llm in engines.items()}
    finally:
        for llm in engines.values():
            llm.close()
    base, base_runs = (summarize_runs(runs[order[0]])[key] for key in ("tok_s", "tok_s_runs"))
    figures, rows = {}, []
    for kv in order:
        s = summarize_runs(runs[kv])
        agree = agreement(tokens[order[0]], tokens[kv])
        paired = bc.median(a / b for a, b in zip(s["tok_s_runs"], base_runs))
        figures[kv] = {**s, "ratio": s["tok_s"] / base, "paired_ratio": paired, "agreement": agree,
                       "num_kv_blocks": stats[kv]["num_kv_blocks"], "kv_cache": stats[kv]["kv_cache_dtype"],
                       "perplexity": ppl.get(kv)}
        tpot = "-" if s["tpot_ms"] is None else f"{s['tpot_ms']:.1f}"
        rows.append([kv, stats[kv]["num_kv_blocks"], bc.fmt(s["tok_s"]), f"{s['tok_s'] / base:.3f}", f"{paired:.3f}",
                     tpot,
                     f"{agree['identical_requests']}/{agree['requests']}", f"{agree['prefix_share']:.3f}",
                     f"{ppl[kv]:.3f}" if ppl else "-"])
    result = {"config": bc.config_dict(args), "workload": workload.describe(), "figures": figures,
              "environment": bc.finish_environment(bc.environment())}
    out = bc.default_out_path(NAME) if args.out is None else args.out
    result = bc.save_result(args, pathlib.Path(out), result, draw)
    print(bc.format_table(["kv_cache_dtype", "KV blocks", "tok/s (median)", "ratio", "paired ratio", "TPOT ms",
                           "identical", "prefix share", "perplexity"],
                          rows, title=f"{workload.num_requests} requests, {args.repeats} repeats, medians"))
    return result

def draw(result: dict):
    """--plot: median throughput per KV format."""
    def plot(plt):
        fig, ax = plt.subplots(figsize=(5, 3))
        names = list(result["figures"])
        ax.bar(names, [result["figures"][kv]["tok_s"] for kv in names])
        ax.set_ylabel("output tok/s (median)")
        ax.set_xlabel("kv_cache_dtype")
        return fig
    return plot


if __name__ == "__main__":
    main()
