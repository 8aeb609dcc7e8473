"""Micro-benchmark of rank 0's CPU work per decode step: schedule + StepPlan build + encode + postprocess.

    python -m nanovllm_tp.launch.bench_step --running 256 1024

No model runs: a GPU engine's step time is bounded below by this, so it must stay well under a decode forward.
"""
import argparse
import json
import random
import statistics
import time

from nanovllm_tp.scheduler import Scheduler, SchedulerConfig, Sequence


def decode_step_times(running: int, steps: int, block_size: int = 16, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(150_000) for _ in range(rng.randint(100, 1024))] for _ in range(running)]
    blocks = sum(len(p) + steps + block_size for p in prompts) // block_size + 16
    sched = Scheduler(SchedulerConfig(num_kvcache_blocks=blocks, kvcache_block_size=block_size,
                                      max_num_seqs=running, max_num_batched_tokens=16384, max_model_len=4096))
    for i, p in enumerate(prompts):
        sched.add(Sequence(i, p, max_tokens=10 * steps, ignore_eos=True))
    while sched.waiting:                        # prefill everything first
        plan = sched.schedule()
        sched.postprocess([1] * plan.num_rows)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        plan = sched.schedule()
        plan.encode()
        sched.postprocess([step % 1000] * plan.num_rows)
        times.append(time.perf_counter() - start)
        assert plan.num_rows == running and not plan.is_prefill
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args(argv)
    rows = []
    for n in args.running:
        times = decode_step_times(n, args.steps)[20:]      # skip the first steps (allocator warm-up)
        rows.append({"running": n, "median_ms": 1e3 * statistics.median(times),
                     "p90_ms": 1e3 * statistics.quantiles(times, n=10)[-1]})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "bench_step", "steps": args.steps, "rows": rows}, f, indent=1)
    print(f"{'running seqs':>12} {'median ms/step':>15} {'p90 ms/step':>12}")
    for r in rows:
        print(f"{r['running']:>12} {r['median_ms']:>15.3f} {r['p90_ms']:>12.3f}")


if __name__ == "__main__":
    main()
