"""Per-request latency: time to first token (TTFT) and time per output token (TPOT) under load.

    python -m nanovllm_tp.bench.latency                            # closed loop, 8 requests in flight
    python -m nanovllm_tp.bench.latency --request-rate 2 4 8       # Poisson arrivals, one run per rate
    python -m nanovllm_tp.bench.latency --concurrency 1 4 16 --plot
    ./torchrun.sh 2 -m nanovllm_tp.bench.latency --tp 2 --request-rate 4

The engine is driven with add_request()/step(), from this process, on the bench workload (random prompt ids,
lengths uniform in --prompt-len / --output-len, ignore_eos). Two kinds of load:

  --request-rate R   open loop: request i arrives at the i-th point of a seeded Poisson process of rate R/s
                     (`inf`: all at once) and is added at the first step boundary after it; TTFT counts from the
                     arrival, so time spent waiting for the running step is part of it. --concurrency C together
                     with a rate caps the requests in flight (arrivals wait in a client queue, still timed).
  --concurrency C    closed loop: C requests in flight, a new one added as soon as one finishes.

TTFT = first token time - arrival; TPOT = (finish - first token) / (output tokens - 1), requests with one token
excluded; e2e = finish - arrival. Each is reported as mean, p50, p90, p99. Several rates / concurrencies give one
run each (the prompt ids are redrawn per run so the prefix cache cannot hit across runs).
"""
from __future__ import annotations

import argparse
import math
import random
import time

from nanovllm_tp.bench import common as bc
from nanovllm_tp.config.engine_config import add_engine_args

NAME = "bench_latency"
QUANTILES = ("mean", "p50", "p90", "p99")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    bc.add_workload_args(parser, num_requests=32)
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, nargs="+",
                      help="Poisson arrival rate(s), requests/s (inf = all at once)")
    load.add_argument("--concurrency", type=int, nargs="+",
                      help="requests in flight: closed loop, or a cap on the open loop when --request-rate is set")
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up generate")
    bc.add_output_args(parser)
    return parser


def load_points(args) -> list[dict]:
    rates, concs = args.request_rate, args.concurrency
    for c in concs or []:
        if c < 1:
            raise SystemExit(f"--concurrency must be >= 1, got {c}")
    for r in rates or []:
        if not r > 0:
            raise SystemExit(f"--request-rate must be > 0 (or inf), got {r}")
    if rates:
        caps = concs or [None]
        return [{"mode": "poisson", "request_rate": r, "concurrency": c} for r in rates for c in caps]
    return [{"mode": "closed", "request_rate": None, "concurrency": c} for c in (concs or [8])]


def label(point: dict) -> str:
    if point["mode"] == "closed":
        return f"concurrency {point['concurrency']}"
    rate = "inf" if math.isinf(point["request_rate"]) else f"{point['request_rate']:g}"
    return f"rate {rate}/s" + (f", max {point['concurrency']}" if point["concurrency"] else "")


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request arrives: a Poisson process (exponential gaps), first at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}/arrivals/{rate}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def run_point(llm, workload: bc.Workload, prompts, point: dict, temperature: float, seed: int) -> dict:
    from nanovllm_tp import SamplingParams
    from nanovllm_tp.sampling_params import RequestOutputKind
    n = workload.num_requests
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True,
                             output_kind=RequestOutputKind.FINAL_ONLY) for m in workload.output_lens]
    offsets = arrival_offsets(n, point["request_rate"], seed) if point["mode"] == "poisson" else None
    cap = point["concurrency"] or n
    arrival: dict[str, float] = {}          # request id -> arrival time (Poisson point, or the add time)
    index: dict[str, int] = {}
    records, in_flight, next_i, steps = [], 0, 0, 0
    start = time.perf_counter()

    def add(i: int, at: float | None) -> None:
        nonlocal in_flight
        rid = llm.add_request(prompts[i], params[i])
        arrival[rid], index[rid] = at, i
        in_flight += 1

    while next_i < n or in_flight:
        now = time.perf_counter()
        while next_i < n and in_flight < cap and (offsets is None or start + offsets[next_i] <= now):
            add(next_i, start + offsets[next_i] if offsets is not None else None)
            next_i += 1
        if not in_flight:      # open loop, nothing to run: wait for the next arrival
            time.sleep(max(0.0, start + offsets[next_i] - time.perf_counter()))
            continue
        finished = llm.step()
        steps += 1
        for out in finished:
            in_flight -= 1
            m = out.metrics
            arrived = arrival.pop(out.request_id)
            arrived = m.arrival_time if arrived is None else arrived
            tokens = len(out.outputs[0].token_ids)
            records.append({
                "index": index.pop(out.request_id), "prompt_tokens": len(out.prompt_token_ids),
                "output_tokens": tokens, "arrival": arrived - start, "added": m.arrival_time - start,
                "ttft": m.first_token_time - arrived,
                "tpot": (m.finish_time - m.first_token_time) / (tokens - 1) if tokens > 1 else None,
                "e2e": m.finish_time - arrived, "finish": m.finish_time - start})
    duration = max(r["finish"] for r in records)
    records.sort(key=lambda r: r["index"])
    out_tokens = sum(r["output_tokens"] for r in records)
    return {
        "label": label(point), **point, "duration_s": duration, "steps": steps,
        "request_throughput": n / duration, "output_tok_s": out_tokens / duration,
        "lengths_ok": [r["output_tokens"] for r in records] == workload.output_lens,
        "ttft": bc.summarize([r["ttft"] for r in records]),
        "tpot": bc.summarize([r["tpot"] for r in records]),
        "e2e": bc.summarize([r["e2e"] for r in records]),
        "queue_delay": bc.summarize([r["added"] - r["arrival"] for r in records]),
        "requests": records,
    }


def table(result: dict) -> str:
    w, c = result["workload"], result["config"]
    rows = []
    for run in result["figures"]["runs"]:
        ms = [None if run[m][q] is None else run[m][q] * 1e3 for m in ("ttft", "tpot") for q in QUANTILES]
        rows.append([run["label"], run["request_throughput"], run["output_tok_s"], *ms])
    title = (f"bench_latency: {w['num_requests']} requests, prompt {w['prompt_len_min']}..{w['prompt_len_max']}, "
             f"output {w['output_len_min']}..{w['output_len_max']}, {c['model_source']}, TP={c['tensor_parallel_size']}; "
             "TTFT/TPOT in ms")
    headers = ["load", "req/s", "out tok/s", "TTFT mean", "p50", "p90", "p99", "TPOT mean", "p50", "p90", "p99"]
    return bc.format_table(headers, rows, title)


def draw(result: dict):
    def _draw(plt):
        runs = result["figures"]["runs"]
        x = range(len(runs))
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, key, name in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
            for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:"), ("mean", "x-")):
                ax.plot(list(x), [(r[key][q] or 0) * 1e3 for r in runs], style, label=q)
            ax.set_xticks(list(x))
            ax.set_xticklabels([r["label"] for r in runs], rotation=20, ha="right")
            ax.set_ylabel(f"{name} (ms)")
            ax.set_title(name)
            ax.legend()
        return fig
    return _draw


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    points = load_points(args)
    bc.apply_threads(args)
    args.model_source = args.model or f"preset {args.preset}"
    args.model = bc.resolve_model(args)
    vocab = bc.model_vocab_size(args.model)
    workload = bc.make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.seed, vocab)
    from nanovllm_tp.bench.engine import warm_up_engine
    from nanovllm_tp.launch.generate import build_llm
    llm = build_llm(args)            # under torchrun, ranks > 0 serve in here and exit when rank 0 is done
    env = bc.environment()
    out_path = bc.out_path(args, NAME)
    runs = []
    try:
        if not args.no_warmup:
            warm_up_engine(llm, vocab, args.seed, args.temperature)
        for k, point in enumerate(points):
            run = run_point(llm, workload, workload.prompts(draw=k + 1), point, args.temperature, args.seed)
            runs.append(run)
            bc.log(args, f"{run['label']}: {run['output_tok_s']:.1f} tok/s, TTFT p50 "
                         f"{run['ttft']['p50'] * 1e3:.1f} ms, TPOT p50 {(run['tpot']['p50'] or 0) * 1e3:.2f} ms")
    finally:
        llm.close()
    result = {"name": NAME, "config": bc.config_dict(args), "workload": workload.describe(),
              "environment": bc.finish_environment(env),
              "figures": {"runs": runs, "units": "seconds (table: ms)",
                          "definitions": {"ttft": "first_token_time - arrival",
                                          "tpot": "(finish_time - first_token_time) / (output_tokens - 1)",
                                          "e2e": "finish_time - arrival",
                                          "queue_delay": "time between arrival and add_request (open loop)"}}}
    bc.save_result(args, out_path, result, draw)
    print(table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
