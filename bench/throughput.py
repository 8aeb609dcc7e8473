"""Offline throughput on nano-vllm's bench workload, optionally against transformers on the same model.

    python -m nanovllm_tp.bench.throughput                              # tiny checkpoint, 64 requests, 16..256
    python -m nanovllm_tp.bench.throughput --compare hf --repeats 3     # + transformers generate and generate_batch
    python -m nanovllm_tp.bench.throughput --preset small --tp 2        # compute-bound random-weight preset, 2 ranks
    python -m nanovllm_tp.bench.throughput --sampling mixed --repeats 5 # sampling knobs on half the rows vs greedy
    python -m nanovllm_tp.bench.throughput --model DIR --compare vllm --peer-python VENV/bin/python  # see vllm.py
    python -m nanovllm_tp.bench.throughput --model F.gguf --compare llamacpp --peer-bin LLAMA/build/bin  # llamacpp.py
    python -m nanovllm_tp.bench.throughput --model DIR --compare openvino --peer-python OV/bin/python  # openvino_compare.py
    ./torchrun.sh 2 -m nanovllm_tp.bench.throughput --tp 2

N requests with random prompt ids; prompt and output lengths uniform in --prompt-len / --output-len; every
request ignores EOS, so it yields exactly its requested tokens. Throughput = requested output tokens / wall time
of one generate() call (after a small warm-up). With --repeats K every measurement runs K times, the engines
interleaved (engine, transformers, engine, ...) so load from other processes hits them alike, and medians are
reported. Each repeat redraws the prompt ids (same lengths), so the prefix cache cannot hit across repeats.

--sampling mixed: each repeat also runs the workload with half the rows sampling with top-p, top-k, min-p,
repetition / presence / frequency penalties and 5 logprobs per token (the other half as --temperature says),
interleaved with the plain run, and reports mixed / plain throughput.

--compare hf, in this process, on the same checkpoint, dtype and device as the engine, same prompts: transformers'
generate on static batches (tried at every --hf-batch-sizes, the fastest by median is reported) and its continuous
batching (--hf-modes picks); how each is driven is in bench/hf.py.
"""
from __future__ import annotations

import argparse
import sys
import time

from nanovllm_tp.bench import common as bc, compare as bench_compare
from nanovllm_tp.bench.engine import run_engine, summarize_runs, warm_up_engine
from nanovllm_tp.bench.hf import HFRunner
from nanovllm_tp.bench.progress import progress_lines
from nanovllm_tp.config.engine_config import add_engine_args

NAME = "bench"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    bc.add_workload_args(parser)
    parser.add_argument("--repeats", type=int, default=1, help="runs per measurement; medians are reported")
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up generate")
    parser.add_argument("--sampling", choices=["plain", "mixed"], default="plain",
                        help="mixed: also run with sampling knobs and logprobs on half the rows, same run")
    g = parser.add_argument_group("comparison with transformers")
    g.add_argument("--compare", choices=["hf", "vllm", "llamacpp", "openvino"],
                   help="also run transformers (hf), vLLM from --peer-python, llama.cpp's llama-server from "
                        "--peer-bin, or OpenVINO GenAI from --peer-python, on the same model and workload")
    g.add_argument("--hf-modes", nargs="+", choices=["generate", "cb"], default=["generate", "cb"],
                   help="which transformers paths to run (default: both)")
    g.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64],
                   help="static batch sizes tried for model.generate (capped at --num-requests)")
    g.add_argument("--hf-cb-max-batch-tokens", type=int, default=None,
                   help="continuous batching: tokens per step (default: min(512, --max-num-batched-tokens); "
                        "its own 8192 default sizes an sdpa mask of GBs on CPU and is slower there)")
    from nanovllm_tp.bench import llamacpp as bench_llamacpp, openvino_compare as bench_openvino, vllm as bench_vllm
    bench_vllm.add_peer_args(parser)
    bench_llamacpp.add_peer_args(parser)
    bench_openvino.add_peer_args(parser)
    bc.add_output_args(parser)
    return parser


# =============================================================================================== summary

def table(result: dict) -> str:
    f, c, w = result["figures"], result["config"], result["workload"]
    engine = f["engine"]
    rows = [[f"nanovllm_tp TP={c['tensor_parallel_size']}", engine["tok_s"], f"{engine['seconds']:.3f}", "1.00",
             bench_compare.share_cell(engine)]]
    if "engine_mixed" in f:
        m = f["engine_mixed"]
        rows.append(["nanovllm_tp, mixed sampling", m["tok_s"], f"{m['seconds']:.3f}",
                     f"{1 / f['ratios']['engine_mixed/engine']:.2f}", "-"])
    for key, label in (("hf_generate", "hf generate"), ("hf_continuous", "hf continuous batching")):
        if key in f:
            e = f[key]
            if key == "hf_generate":
                label += f" (bs={e['batch_size']})"
            ratio = f["ratios"].get(f"engine/{key}")
            rows.append([label, e["tok_s"], f"{e['seconds']:.3f}", f"{ratio:.2f}" if ratio else "-",
                         bench_compare.share_cell(e)])
    title = (f"bench: {w['num_requests']} requests, prompt {w['prompt_len_min']}..{w['prompt_len_max']}, output "
             f"{w['output_len_min']}..{w['output_len_max']} ({w['requested_output_tokens']} requested tokens), "
             f"{c['model_source']}, T={c['temperature']}, "
             f"median of {c['repeats']}, torch threads {result['environment']['torch_threads']}")
    return bc.format_table(["engine", "output tok/s", "seconds", "engine/this", "GB/s read (of bandwidth)"], rows,
                           title)


def draw(result: dict):
    def _draw(plt):
        f = result["figures"]
        labels, values, lo, hi = [], [], [], []
        for key, label in (("engine", "nanovllm_tp"), ("hf_generate", "hf generate"),
                           ("hf_continuous", "hf CB")):
            if key in f:
                labels.append(label if key != "hf_generate" else f"{label}\nbs={f[key]['batch_size']}")
                values.append(f[key]["tok_s"])
                lo.append(f[key]["tok_s"] - min(f[key]["tok_s_runs"]))
                hi.append(max(f[key]["tok_s_runs"]) - f[key]["tok_s"])
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(labels, values, yerr=[lo, hi], capsize=4, color=["C0", "C1", "C2"][:len(values)])
        ax.set_ylabel("output tokens / s (median, min-max)")
        ax.set_title(f"throughput, {result['workload']['num_requests']} requests")
        return fig
    return _draw


# =============================================================================================== main

def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.compare == "vllm":
        from nanovllm_tp.bench import vllm as bench_vllm
        return bench_vllm.main(args)
    if args.compare == "llamacpp":
        from nanovllm_tp.bench import llamacpp as bench_llamacpp
        return bench_llamacpp.main(args)
    if args.compare == "openvino":
        from nanovllm_tp.bench import openvino_compare as bench_openvino
        return bench_openvino.main(args)
    if args.compare and "generate" in args.hf_modes and not any(b > 0 for b in args.hf_batch_sizes):
        raise SystemExit("--hf-batch-sizes needs at least one size >= 1")
    bc.apply_threads(args)
    args.model_source = args.model or f"preset {args.preset}"
    args.model = bc.resolve_model(args)
    vocab = bc.model_vocab_size(args.model)
    workload = bc.make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.seed, vocab)
    from nanovllm_tp.launch.generate import build_llm
    t0 = time.perf_counter()
    llm = build_llm(args)            # under torchrun, ranks > 0 serve in here and exit when rank 0 is done
    build_s = time.perf_counter() - t0
    env = bc.environment()
    out_path = bc.out_path(args, NAME)
    runner_desc = llm.engine.runner.describe()
    bc.log(args, f"engine ready in {build_s:.1f}s: {runner_desc}")
    extra = {"engine_build_s": build_s}
    hf = None
    try:
        if not args.no_warmup:
            bc.log(args, "warming up the engine")
            extra["engine_warmup_s"] = warm_up_engine(llm, vocab, args.seed, args.temperature)
        if args.compare == "hf":
            cb_tokens = args.hf_cb_max_batch_tokens or min(512, args.max_num_batched_tokens)
            hf = HFRunner(args.model, llm.engine.dtype, llm.engine.device, args.temperature, args.seed, cb_tokens)
            extra["hf_warmup_s"] = hf.warm_up(vocab, args.hf_modes)
        batch_sizes = sorted({min(b, workload.num_requests) for b in args.hf_batch_sizes if b > 0})
        engine_runs, static_runs, cb_runs, mixed_runs = [], {b: [] for b in batch_sizes}, [], []
        for r in range(args.repeats):
            prompts = workload.prompts(draw=r + 1)
            engine_runs.append(run_engine(llm, workload, prompts, args.temperature,
                                          progress=progress_lines(args, f"[{r + 1}/{args.repeats}] engine")))
            bc.log(args, f"[{r + 1}/{args.repeats}] engine: {engine_runs[-1]['tok_s']:.1f} tok/s "
                         f"in {engine_runs[-1]['seconds']:.2f}s")
            if args.sampling == "mixed":      # fresh prompts: no prefix hits from the plain run
                mixed_runs.append(run_engine(llm, workload, workload.prompts(draw=1000 + r), args.temperature, True,
                                             progress_lines(args, f"[{r + 1}/{args.repeats}] engine, mixed")))
                bc.log(args, f"[{r + 1}/{args.repeats}] engine, mixed sampling: {mixed_runs[-1]['tok_s']:.1f} tok/s")
            if hf is None:
                continue
            if "generate" in args.hf_modes:
                for b in batch_sizes:
                    static_runs[b].append(hf.generate_static(workload, prompts, b))
                    bc.log(args, f"[{r + 1}/{args.repeats}] hf generate bs={b}: "
                                 f"{static_runs[b][-1]['tok_s']:.1f} tok/s")
            if "cb" in args.hf_modes:
                cb_runs.append(hf.generate_cb(workload, prompts))
                bc.log(args, f"[{r + 1}/{args.repeats}] hf continuous batching: {cb_runs[-1]['tok_s']:.1f} tok/s")
        share = bench_compare.one_stream_share(args, llm, workload, engine_runs)
        in_flight = llm.engine.stats()["max_steps_in_flight"]
    finally:
        llm.close()

    figures = {"engine": {**summarize_runs(engine_runs), "tp": args.tensor_parallel_size, "runner": runner_desc,
                          "max_steps_in_flight": in_flight}, "ratios": {}}
    if share:
        figures["engine"]["decode_share"] = share
    if hf is not None and "generate" in args.hf_modes:
        sweep = {str(b): summarize_runs(runs) for b, runs in static_runs.items()}
        best = max(batch_sizes, key=lambda b: sweep[str(b)]["tok_s"])
        figures["hf_generate"] = {**sweep[str(best)], "batch_size": best, "sweep": sweep,
                                  "choice": "fastest median tok/s over the batch sizes in 'sweep'; requests sorted "
                                            "by (requested output, prompt) length, left-padded, min_new_tokens = "
                                            "max_new_tokens = the batch's largest requested output"}
    if hf is not None and "cb" in args.hf_modes:
        figures["hf_continuous"] = {**summarize_runs(cb_runs), "config": hf.cb_config(workload),
                                    "path": "init_continuous_batching + add_request(max_new_tokens=per request, "
                                            "eos_token_id=-1)"}
    if mixed_runs:
        figures["engine_mixed"] = {**summarize_runs(mixed_runs), "knobs": "odd rows: T=0.8, top_p=0.9, top_k=50, "
                                   "min_p=0.02, repetition 1.1, presence 0.3, frequency 0.2, logprobs=5"}
        figures["ratios"]["engine_mixed/engine"] = bc.median(m["tok_s"] / e["tok_s"]
                                                             for m, e in zip(mixed_runs, engine_runs))
    for key in ("hf_generate", "hf_continuous"):
        if key in figures:
            figures["ratios"][f"engine/{key}"] = figures["engine"]["tok_s"] / figures[key]["tok_s"]
    if hf is not None:
        figures["hf"] = {"attn_implementation": hf.attn_implementation, "dtype": str(llm.engine.dtype),
                         "device": str(llm.engine.device)}
    bench_compare.add_shares(figures)
    figures["total_tok_s"] = (workload.prompt_tokens + workload.requested_output_tokens) / figures["engine"]["seconds"]
    result = {"name": NAME, "config": bc.config_dict(args), "workload": workload.describe(),
              "environment": bc.finish_environment(env), "timings": extra, "figures": figures}
    bc.save_result(args, out_path, result, draw)
    if not figures["engine"]["lengths_ok"]:
        print("WARNING: the engine did not produce the requested number of tokens for every request",
              file=sys.stderr)
    print(table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
