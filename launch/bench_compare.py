"""What a comparison with a peer engine shares (bench --compare vllm, --compare llamacpp; bench_spec): the
engine's cold start, the interleaved repeats on the same prompts, a run's throughput, greedy agreement, the ratios
engine / peer, and signals to a peer's process group (a peer is stopped whenever it is not answering)."""
from __future__ import annotations

import os
import subprocess
import time

from nanovllm_tp.launch import bench_common as bc
from nanovllm_tp.launch import bench_engine


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
