"""Micro-benchmarks of the CPU-side costs that bound a GPU engine's step:
rank 0's schedule + StepPlan build + encode + postprocess per decode step; a worker's plan intake (decode,
then the limits check every rank runs before any kernel); and the plan's broadcast from the writer to every
reader (shared-memory ring on one node, ZMQ on loopback standing in for other nodes), with the channel's
authentication (CURVE) on and off.

    python -m nanovllm_tp.bench.step --running 256 1024 --block-size 256 --readers 1 2
    python -m nanovllm_tp.bench.step --running 256 --block-size 256 --readers 1 --transport shm zmq \
        --auth on off
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
        sched.postprocess([1] * len(sched.schedule().sampling))
    times = []
    for i in range(steps):
        start = time.perf_counter()
        step = sched.schedule()
        step.plan.encode()
        sched.postprocess([i % 1000] * len(step.sampling))
        times.append(time.perf_counter() - start)
        assert step.plan.num_rows == running and not step.plan.is_prefill
    return times


def decode_plan_bytes(running: int, block_size: int) -> int:
    """Size of an encoded decode plan for `running` sequences with prompts of 100..1024 tokens."""
    return len(_decode_plan(running, block_size)[0])


def plan_intake_times(running: int, block_size: int, iterations: int = 3000) -> dict:
    """A worker's per-step intake of a decode plan: StepPlan.decode, then check_plan against its limits (µs)."""
    from nanovllm_tp.scheduler.plan import StepPlan
    from nanovllm_tp.workers.plan_check import PlanLimits, check_plan
    data, num_blocks = _decode_plan(running, block_size)
    limits = PlanLimits(num_blocks=num_blocks, block_size=block_size, max_model_len=4096, vocab_size=151_936)
    plan = StepPlan.decode(data)
    out = {"running": running, "block_size": block_size, "plan_bytes": len(data)}
    for name, work in (("decode", lambda: StepPlan.decode(data)), ("check", lambda: check_plan(plan, limits))):
        times = []
        for _ in range(iterations):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        out[f"{name}_median_us"] = 1e6 * statistics.median(times)
    return out


def _decode_plan(running: int, block_size: int) -> tuple[bytes, int]:
    rng = random.Random(1)
    prompts = [[rng.randrange(150_000) for _ in range(rng.randint(100, 1024))] for _ in range(running)]
    num_blocks = sum((len(p) + 200) // block_size + 2 for p in prompts) + 16
    sched = Scheduler(SchedulerConfig(num_kvcache_blocks=num_blocks, kvcache_block_size=block_size,
                                      max_num_seqs=running, max_num_batched_tokens=16384, max_model_len=4096))
    for i, p in enumerate(prompts):
        sched.add(Sequence(i, p, max_tokens=100, ignore_eos=True))
    while sched.waiting:
        sched.postprocess([1] * len(sched.schedule().sampling))
    return sched.schedule().plan.encode(), num_blocks


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--block-size", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--readers", type=int, nargs="*", default=[1, 2],
                        help="plan broadcast readers to measure (256-sequence plan); none to skip")
    parser.add_argument("--transport", nargs="+", choices=["shm", "zmq"], default=["shm"],
                        help="broadcast to same-node (shm) and/or ZMQ-on-loopback readers")
    parser.add_argument("--auth", nargs="+", choices=["on", "off"], default=["on"],
                        help="broadcast with the channel's CURVE authentication on and/or off")
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args(argv)
    rows, casts = [], []
    for bs in args.block_size:
        for n in args.running:
            times = decode_step_times(n, args.steps, block_size=bs)[20:]   # skip allocator warm-up steps
            rows.append({"running": n, "block_size": bs, "median_ms": 1e3 * statistics.median(times),
                         "p90_ms": 1e3 * statistics.quantiles(times, n=10)[-1]})
    intake = [plan_intake_times(n, bs) for bs in args.block_size for n in args.running]
    if args.readers:
        from nanovllm_tp.distributed.channel_bench import measure_broadcast_latency
        for bs in args.block_size:
            size = decode_plan_bytes(256, bs)
            for readers in args.readers:
                for transport in args.transport:
                    for auth in args.auth:
                        lat = measure_broadcast_latency(payload_bytes=size, readers=readers, iterations=1000,
                                                        secure=auth == "on", remote=transport == "zmq")
                        casts.append({"readers": readers, "block_size": bs, "plan_bytes": size, **lat})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "bench_step", "steps": args.steps, "rows": rows, "plan_intake": intake,
                       "broadcast": casts}, f, indent=1, default=str)
    print(f"{'running seqs':>12} {'block size':>10} {'median ms/step':>15} {'p90 ms/step':>12}")
    for r in rows:
        print(f"{r['running']:>12} {r['block_size']:>10} {r['median_ms']:>15.3f} {r['p90_ms']:>12.3f}")
    print(f"\n{'worker intake: rows':>19} {'block size':>10} {'plan bytes':>10} {'decode us':>10} {'check us':>9}")
    for r in intake:
        print(f"{r['running']:>19} {r['block_size']:>10} {r['plan_bytes']:>10} {r['decode_median_us']:>10.1f} "
              f"{r['check_median_us']:>9.1f}")
    if casts:
        print(f"\n{'broadcast: readers':>18} {'transport':>9} {'auth':>5} {'block size':>10} {'plan bytes':>10} "
              f"{'median us':>10} {'p90 us':>8}")
        for c in casts:
            print(f"{c['readers']:>18} {c['transport']:>9} {'on' if c['authenticated'] else 'off':>5} "
                  f"{c['block_size']:>10} {c['plan_bytes']:>10} {c.get('median_us', float('nan')):>10.1f} "
                  f"{c.get('p90_us', float('nan')):>8.1f}")


if __name__ == "__main__":
    main()
