"""Micro-benchmarks of the two CPU-side costs that bound a GPU engine's step:
rank 0's schedule + StepPlan build + encode + postprocess per decode step, and the plan's broadcast from the
writer to every same-node reader (shared-memory ring).

    python -m nanovllm_tp.launch.bench_step --running 256 1024 --block-size 256 --readers 1 2
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
    # room for every prompt, the timed steps, and the tokens rows decode in the mixed steps that admit the rest
    blocks = sum(len(p) + 2 * steps + block_size for p in prompts) // block_size + 16
    sched = Scheduler(SchedulerConfig(num_kvcache_blocks=blocks, kvcache_block_size=block_size,
                                      max_num_seqs=running, max_num_batched_tokens=16384, max_model_len=4096))
    for i, p in enumerate(prompts):
        sched.add(Sequence(i, p, max_tokens=10 * steps, ignore_eos=True))
    while sched.waiting:                        # prefill everything first
        plan = sched.schedule()
        sched.postprocess([1] * len(sched.sampling))
    times = []
    for step in range(steps):
        start = time.perf_counter()
        plan = sched.schedule()
        plan.encode()
        sched.postprocess([step % 1000] * len(sched.sampling))
        times.append(time.perf_counter() - start)
        assert plan.num_rows == running and not plan.is_prefill
    return times


def decode_plan_bytes(running: int, block_size: int) -> int:
    """Size of an encoded decode plan for `running` sequences with prompts of 100..1024 tokens."""
    rng = random.Random(1)
    prompts = [[rng.randrange(150_000) for _ in range(rng.randint(100, 1024))] for _ in range(running)]
    sched = Scheduler(SchedulerConfig(num_kvcache_blocks=sum((len(p) + 200) // block_size + 2 for p in prompts) + 16,
                                      kvcache_block_size=block_size, max_num_seqs=running,
                                      max_num_batched_tokens=16384, max_model_len=4096))
    for i, p in enumerate(prompts):
        sched.add(Sequence(i, p, max_tokens=100, ignore_eos=True))
    while sched.waiting:
        sched.schedule()
        sched.postprocess([1] * len(sched.sampling))
    return len(sched.schedule().encode())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--block-size", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--readers", type=int, nargs="*", default=[1, 2],
                        help="plan broadcast readers to measure (256-sequence plan); none to skip")
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args(argv)
    rows, casts = [], []
    for bs in args.block_size:
        for n in args.running:
            times = decode_step_times(n, args.steps, block_size=bs)[20:]   # skip allocator warm-up steps
            rows.append({"running": n, "block_size": bs, "median_ms": 1e3 * statistics.median(times),
                         "p90_ms": 1e3 * statistics.quantiles(times, n=10)[-1]})
    if args.readers:
        from nanovllm_tp.distributed.channel_bench import measure_broadcast_latency
        for bs in args.block_size:
            size = decode_plan_bytes(256, bs)
            for readers in args.readers:
                lat = measure_broadcast_latency(payload_bytes=size, readers=readers, iterations=1000)
                casts.append({"readers": readers, "block_size": bs, "plan_bytes": size, **lat})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "bench_step", "steps": args.steps, "rows": rows, "broadcast": casts}, f,
                      indent=1, default=str)
    print(f"{'running seqs':>12} {'block size':>10} {'median ms/step':>15} {'p90 ms/step':>12}")
    for r in rows:
        print(f"{r['running']:>12} {r['block_size']:>10} {r['median_ms']:>15.3f} {r['p90_ms']:>12.3f}")
    if casts:
        print(f"\n{'broadcast: readers':>18} {'block size':>10} {'plan bytes':>10} {'median us':>10} {'p90 us':>8}")
        for c in casts:
            print(f"{c['readers']:>18} {c['block_size']:>10} {c['plan_bytes']:>10} "
                  f"{c.get('median_us', float('nan')):>10.1f} {c.get('p90_us', float('nan')):>8.1f}")


if __name__ == "__main__":
    main()
