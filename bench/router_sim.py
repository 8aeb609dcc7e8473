"""What a router policy does to the prefix cache, in seconds and without a model: D replicas, each the engine's own
Scheduler and BlockManager, behind the serving router (serving/router.py), fed the shared-prefix workload of
`bench serve --dataset shared-prefix` by a closed loop of --concurrency streams. A step takes a modelled time (a
fixed cost plus a cost per token it computes: a prefill of 600 tokens costs what it costs, a cache hit skips it),
so a replica given more work runs slower and holds its requests longer, as a real one does; the replicas step in
parallel on their own clocks, and each stream sends its next request when its last one ends.

    nanovllm-tp bench router-sim                        # D=2 at 202 blocks each: every policy, and one engine
    nanovllm-tp bench router-sim --kv-blocks 1455 --router prefix-aware --miss-threshold 8

Reported per policy (medians over --repeats; the first repeat starts cold, the prefixes stay cached after it): the
hit rate as the servers count it (prompt tokens found in the cache / prompt tokens looked up), the makespan of the
repeat in modelled seconds and the TTFT p50 (send to the end of the prompt's last prefill step); and "one engine":
the same workload on one replica with all D replicas' blocks, the hit rate routing is measured against. The
model's answers play no part (every request runs to its max_tokens), so this isolates what routing and the cache do;
`bench serve --launch --data-parallel-size D --router ...` measures the same workload on real servers.
"""
from __future__ import annotations

import argparse
import statistics

from nanovllm_tp.bench import common as bc
from nanovllm_tp.scheduler.scheduler import Scheduler, SchedulerConfig
from nanovllm_tp.scheduler.sequence import Sequence
from nanovllm_tp.serving.router import POLICIES, ReplicaLoad, make_router

NAME = "router_sim"


def simulate(policy: str, replicas: int, kv_blocks: int, requests: list[tuple[list[int], int]], *,
             concurrency: int, block_size: int = 16, max_model_len: int = 1024, step_s: float = 0.010,
             token_s: float = 0.0005, router_kwargs: dict | None = None, state: dict | None = None,
             max_num_seqs: int = 256) -> dict:
    """One repeat: `requests` (prompt, output length) through a closed loop of `concurrency` streams. `state`
    carries the replicas, router and clocks from one repeat to the next (what stays cached); pass the same dict."""
    if replicas < 1 or kv_blocks < 1 or concurrency < 1 or not requests:
        raise ValueError(f"need replicas, kv_blocks, concurrency >= 1 and some requests, got {replicas}, "
                         f"{kv_blocks}, {concurrency}, {len(requests)}")
    state = {} if state is None else state
    if not state:
        config = SchedulerConfig(kv_blocks, block_size, max_model_len, max_num_seqs)
        state.update(scheds=[Scheduler(config) for _ in range(replicas)], clock=[0.0] * replicas, next_id=0,
                     router=make_router(policy, replicas, block_size, **(router_kwargs or {})),
                     reported=[[0, 0, 0.0] for _ in range(replicas)], unreported=[0] * replicas)
    # what the router sees, as from a server: each replica's figures as of the end of its last step, and the
    # requests sent to it since
    reported, unreported = state["reported"], state["unreported"]
    scheds, clock, router = state["scheds"], state["clock"], state["router"]
    hits0 = sum(s.block_manager.num_prefix_hit_tokens for s in scheds)
    queries0 = sum(s.block_manager.num_prefix_query_tokens for s in scheds)
    start = max(clock)
    sent: dict[int, float] = {}          # open requests: id -> when sent
    ttfts: list[float] = []
    pending = iter(requests)

    def submit(now: float) -> None:
        prompt, output_len = next(pending)
        loads = [ReplicaLoad(running, waiting, usage, pending=unreported[i], max_seqs=max_num_seqs)
                 for i, (running, waiting, usage) in enumerate(reported)]
        replica = router.route(prompt, loads)
        unreported[replica] += 1
        seq = Sequence(state["next_id"], prompt, max_tokens=output_len, ignore_eos=True)
        state["next_id"] += 1
        scheds[replica].add(seq)
        sent[seq.seq_id] = now
        clock[replica] = max(clock[replica], now)

    issued = min(concurrency, len(requests))
    for _ in range(issued):
        submit(start)
    done = 0
    while done < len(requests):
        i = min((i for i, s in enumerate(scheds) if s.has_unfinished()), key=lambda i: clock[i])
        step = scheds[i].schedule()
        clock[i] += step_s + token_s * int(step.plan.num_tokens)
        progressed = scheds[i].postprocess([0] * len(step.sampling.seqs))
        reported[i] = [len(scheds[i].running), len(scheds[i].waiting), scheds[i].block_manager.usage()]
        unreported[i] = 0
        for seq in progressed:
            if seq.num_completion_tokens == 1:
                ttfts.append(clock[i] - sent[seq.seq_id])
            if seq.is_finished:
                del sent[seq.seq_id]
                done += 1
                if issued < len(requests):
                    issued += 1
                    submit(clock[i])
    hits = sum(s.block_manager.num_prefix_hit_tokens for s in scheds) - hits0
    queries = sum(s.block_manager.num_prefix_query_tokens for s in scheds) - queries0
    return {"hit_rate": hits / queries, "makespan_s": max(clock) - start, "ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": bc.percentile(ttfts, 90),
            "routed": router.counters()["routed"]}


def requests_of(args, draw: int) -> list[tuple[list[int], int]]:
    workload = bc.make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.seed,
                                vocab_size=10_001)
    prompts = bc.shared_prefix_prompts(workload, draw, args.num_prefixes, args.prefix_len)
    return list(zip(prompts, workload.output_lens))


def run_policy(args, policy: str, replicas: int, kv_blocks: int) -> dict:
    kwargs = {"load_threshold": args.load_threshold, "miss_threshold": args.miss_threshold,
              "idle_routes": args.idle_routes, "queue_match": args.queue_match} if policy == "prefix-aware" else {}
    state: dict = {}
    runs = [simulate(policy, replicas, kv_blocks, requests_of(args, r + 1), concurrency=args.concurrency,
                     block_size=args.block_size, max_model_len=args.max_model_len, step_s=args.step_ms / 1e3,
                     token_s=args.token_ms / 1e3, router_kwargs=kwargs, state=state, max_num_seqs=args.max_num_seqs)
            for r in range(args.repeats)]
    return {"policy": policy, "replicas": replicas, "kv_blocks": kv_blocks,
            "hit_rate": bc.median([r["hit_rate"] for r in runs]), "hit_rates": [r["hit_rate"] for r in runs],
            "makespan_s": bc.median([r["makespan_s"] for r in runs]),
            "ttft_p50_s": bc.median([r["ttft_p50_s"] for r in runs]),
            "ttft_p90_s": bc.median([r["ttft_p90_s"] for r in runs]), "routed": runs[-1]["routed"]}


def table(rows: list[dict], ratios: dict) -> str:
    cells = [[r["layout"], f"{r['hit_rate']:.1%}", " / ".join(f"{h:.1%}" for h in r["hit_rates"]),
              f"{r['makespan_s']:.2f}", f"{r['ttft_p50_s'] * 1e3:.0f}", f"{r['ttft_p90_s'] * 1e3:.0f}",
              ratios.get(r["layout"], "")] for r in rows]
    return bc.format_table(["layout, policy", "hit rate", "repeats", "makespan s", "TTFT p50 ms", "TTFT p90 ms",
                            "ratios"], cells,
                           title="router simulation (modelled time; medians)")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=2)
    parser.add_argument("--router", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    parser.add_argument("--kv-blocks", type=int, default=202, help="KV blocks per replica (default: %(default)s, "
                        "what 150 MB holds for SmolLM2-135M in bf16)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[16, 64], metavar=("LO", "HI"),
                        help="tokens after the prefix, uniform in [LO, HI]")
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 32], metavar=("LO", "HI"))
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=16, help="streams in the closed loop")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="each replica's sequences at once")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-ms", type=float, default=10.0, help="modelled cost of a step")
    parser.add_argument("--token-ms", type=float, default=0.5, help="modelled cost of each token a step computes")
    parser.add_argument("--load-threshold", type=float, default=8, help="prefix-aware's (router.py)")
    parser.add_argument("--miss-threshold", type=float, default=16, help="prefix-aware's (router.py)")
    parser.add_argument("--idle-routes", type=int, default=8, help="prefix-aware's (router.py)")
    parser.add_argument("--queue-match", type=int, default=8, help="prefix-aware's (router.py; 0: patience only)")
    parser.add_argument("--no-one-engine", action="store_true", help="skip the one-engine reference run")
    bc.add_output_args(parser)
    args = parser.parse_args(argv)
    if args.data_parallel_size < 1 or args.repeats < 1:
        parser.error("--data-parallel-size and --repeats must be at least 1")
    env = bc.environment()
    rows = []
    for policy in args.router:
        bc.log(args, f"--- D={args.data_parallel_size} {policy}")
        rows.append({"layout": f"D={args.data_parallel_size}, {policy}",
                     **run_policy(args, policy, args.data_parallel_size, args.kv_blocks)})
    if not args.no_one_engine:
        rows.append({"layout": f"one engine, {args.data_parallel_size * args.kv_blocks} blocks",
                     **run_policy(args, "round-robin", 1, args.data_parallel_size * args.kv_blocks)})
    one = rows[-1]["hit_rate"] if not args.no_one_engine else None
    rr = next((r["hit_rate"] for r in rows if r["policy"] == "round-robin" and r["replicas"] > 1), None)
    ratios, figures = {}, {"runs": rows, "hit_rate_vs_round_robin": {}, "hit_rate_vs_one_engine": {}}
    for r in rows[:len(args.router)]:
        parts = []
        if rr and r["policy"] != "round-robin":
            figures["hit_rate_vs_round_robin"][r["policy"]] = r["hit_rate"] / rr
            parts.append(f"{r['hit_rate'] / rr:.2f}x round-robin")
        if one:
            figures["hit_rate_vs_one_engine"][r["policy"]] = r["hit_rate"] / one
            parts.append(f"{r['hit_rate'] / one:.2f}x one engine")
        ratios[r["layout"]] = ", ".join(parts)
    return bc.finish(args, NAME, env, table(rows, ratios), figures=figures)


if __name__ == "__main__":
    main()
