"""What a comparison with a peer engine shares (bench --compare vllm, llamacpp, openvino; bench_spec): the
engine's cold start, the interleaved repeats on the same prompts, a run's throughput, greedy agreement, the ratios
engine / peer, the share of read bandwidth of a one-stream run (every engine's: they read the same model), and
signals to a peer's process group (a peer is stopped whenever it is not answering)."""
from __future__ import annotations

import os
import subprocess
import time

from nanovllm_tp.bench import common as bc
from nanovllm_tp.bench import engine as bench_engine


def signal_group(proc: subprocess.Popen, sig) -> None:
    """To a peer started in a session of its own: its whole process group (gone already: nothing to do)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def cold_engine(args, cold_prompt: list[int]):
    """The engine, and its cold start: LLM(...) until built (load_s) and until the first token of cold_prompt."""
    from nanovllm_tp import SamplingParams
    from nanovllm_tp.launch.generate import build_llm
    t0 = time.perf_counter()
    llm = build_llm(args)
    t1 = time.perf_counter()
    try:
        llm.generate([cold_prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    except BaseException:
        llm.close()
        raise
    return llm, {"load_s": t1 - t0, "first_token_s": time.perf_counter() - t0}


def interleave(args, llm, workload: bc.Workload, peers: dict, runs: dict) -> None:
    """--repeats rounds: the engine, then each peer (`run(prompts, max_tokens, temperature)` -> seconds and
    token_ids), on the same freshly drawn prompts; each run appended to runs[name] ("engine" for ours)."""
    params = bench_engine.sampling_params(workload, args.temperature)
    for r in range(args.repeats):
        prompts = workload.prompts(draw=r + 1)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs["engine"].append(timed(time.perf_counter() - t, workload, [list(o.outputs[0].token_ids)
                                                                         for o in outs]))
        for name, peer in peers.items():
            reply = peer.run(prompts, workload.output_lens, args.temperature)
            runs[name].append(timed(reply["seconds"], workload, reply["token_ids"]))
        bc.log(args, f"[{r + 1}/{args.repeats}] " + ", ".join(f"{k}: {v[-1]['tok_s']:.1f} tok/s"
                                                           for k, v in runs.items()))


def one_stream_share(args, llm, workload: bc.Workload, runs: list[dict]) -> dict | None:
    """With one request: the engine's bytes read per token x its median tok/s, as a share of the read bandwidth
    at the run's threads (bench/bandwidth.py); None for a batch."""
    if workload.num_requests != 1:
        return None
    import torch

    from nanovllm_tp.bench.bandwidth import one_stream_share as share
    threads = torch.get_num_threads() * max(1, getattr(args, "tensor_parallel_size", 1) or 1)
    threads = min(threads, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else threads)
    return share(llm, args.model, workload, bc.median(r["tok_s"] for r in runs), threads)


def add_shares(figures: dict) -> None:
    """Each peer's share of read bandwidth from the engine's bytes per token (the same model) and its tok/s."""
    engine = figures.get("engine", {}).get("decode_share")
    if not engine:
        return
    from nanovllm_tp.bench.bandwidth import decode_share
    for key, f in figures.items():
        if key != "engine" and isinstance(f, dict) and "tok_s" in f:
            f["decode_share"] = decode_share(f["tok_s"], engine["weight_bytes"], engine["kv_bytes"],
                                             engine["bandwidth_gb_s"])


def share_cell(figure: dict) -> str:
    """'GB/s (share of read bandwidth)' of a one-stream figure, '-' for a batch."""
    s = figure.get("decode_share")
    return f"{s['gb_s']:.1f} ({s['share']:.0%})" if s else "-"


def peer_figures(ours: list[dict], peer: list[dict], ready: dict, keys) -> dict:
    """A peer's medians, the `keys` of its ready record, its ratios to the engine and its greedy agreement."""
    parts = [agreement(a["token_ids"], b["token_ids"]) for a, b in zip(ours, peer)]
    return {**bench_engine.summarize_runs(peer), **{k: ready[k] for k in keys}, "ratio": ratios(ours, peer),
            "agreement": merge_agreement(parts)}


def timed(seconds: float, workload: bc.Workload, token_ids: list[list[int]]) -> dict:
    produced = [len(t) for t in token_ids]
    return {"seconds": seconds, "tok_s": workload.requested_output_tokens / seconds,
            "lengths_ok": produced == workload.output_lens, "token_ids": token_ids}


def agreement(ours: list[list[int]], peer: list[list[int]]) -> dict:
    """How far greedy outputs agree: identical requests, and tokens before each request's first difference."""
    if len(ours) != len(peer):
        raise ValueError(f"{len(ours)} requests vs {len(peer)}")
    same_prefix = []
    for a, b in zip(ours, peer):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same_prefix.append(n)
    identical = sum(a == b for a, b in zip(ours, peer))
    return {"requests": len(ours), "identical": identical, "tokens": sum(len(a) for a in ours),
            "tokens_before_first_difference": sum(same_prefix)}


def merge_agreement(parts: list[dict]) -> dict:
    return {k: sum(p[k] for p in parts) for k in ("requests", "identical", "tokens", "tokens_before_first_difference")}


def ratios(ours: list[dict], peer: list[dict]) -> dict:
    """engine / peer throughput: of the medians, and the median of the per-repeat ratios (repeat i vs i)."""
    per = [a["tok_s"] / b["tok_s"] for a, b in zip(ours, peer)]
    return {"of_medians": bc.median(a["tok_s"] for a in ours) / bc.median(b["tok_s"] for b in peer),
            "median_of_repeats": bc.median(per), "repeats": [round(r, 3) for r in per]}


def table(result: dict, peer: str, peers: dict) -> str:
    """The engine's row, then one per peer present in the figures (peers: figure key -> label): medians, the ratio
    engine / peer (of the medians, and the median of the per-repeat ratios), agreement and cold start."""
    figures, c, w = result["figures"], result["config"], result["workload"]
    e = figures["engine"]
    rows = [["nanovllm_tp", e["tok_s"], f"{e['seconds']:.3f}", "1.00", "-", "-", f"{e['load_s']:.1f}",
             f"{e['first_token_s']:.1f}", share_cell(e)]]
    for key, label in peers.items():
        if key in figures:
            p = figures[key]
            a, r = p["agreement"], p["ratio"]
            rows.append([label, p["tok_s"], f"{p['seconds']:.3f}", f"{r['of_medians']:.2f}",
                         f"{r['median_of_repeats']:.2f}", f"{a['identical']}/{a['requests']}", f"{p['load_s']:.1f}",
                         f"{p['first_token_s']:.1f}", share_cell(p)])
    title = (f"bench vs {peer}: {w['num_requests']} requests, prompt {w['prompt_len_min']}..{w['prompt_len_max']}, "
             f"output {w['output_len_min']}..{w['output_len_max']} ({w['requested_output_tokens']} tokens), "
             f"{c['model_source']}, dtype {e['dtype']}, T={c['temperature']}, median of {c['repeats']}")
    return bc.format_table(["engine", "output tok/s", "seconds", "ours/this", "paired", "same tokens", "load s",
                            "first token s", "GB/s read (of bandwidth)"], rows, title)


def draw(result: dict):
    """Bars: the median output tok/s of the engine and of every peer in the figures."""
    def _draw(plt):
        f = result["figures"]
        keys = [k for k, v in f.items() if isinstance(v, dict) and "tok_s" in v]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([{"engine": "nanovllm_tp"}.get(k, k.replace("_", " ")) for k in keys], [f[k]["tok_s"] for k in keys],
               color=[f"C{i}" for i in range(len(keys))])
        ax.set_ylabel("output tokens / s (median)")
        return fig
    return _draw
