"""Micro-benchmark of the plan channel's shared-memory broadcast latency.

Method (one-way, no round-trip halving): the writer (calling process) takes
``t0 = time.perf_counter_ns()`` right before ``publish``; each reader process takes
``perf_counter_ns()`` right after ``receive`` returns (the payload is already copied into a
``bytes`` object by then) and stores it, with the plan number, in its own cache line of a small
shared "ack" segment.  On Linux ``perf_counter_ns`` is CLOCK_MONOTONIC, one clock for all
processes on the machine, so ``max(reader stamps) - t0`` is the time until the LAST reader
has the plan.  The writer then waits for every ack (untimed; it polls with ``sched_yield`` so
a reader sharing its core can run), sleeps ``gap_s`` and sends the next plan; readers are
therefore already waiting in ``receive`` (spinning, or napping once idle longer than their
``spin_s``) when a plan is published.  Warm-up plans are excluded.

Numbers depend heavily on core count and machine load: with more busy processes than cores
(writer + 2 readers on 2 cores) the scheduler, not the channel, dominates.  ``pin=True`` puts
the writer on the first allowed CPU and the readers on the others, as an engine that pins
its ranks would.  The result carries the 1-minute load average for context.
"""
from __future__ import annotations

import json
import os
import secrets
import statistics
import struct
import subprocess
import sys
import time
from multiprocessing import shared_memory

_ACK = struct.Struct("<QQ")  # plan number, receive stamp (ns)
_LINE = 64


def _bench_reader(port: int, rank: int, ack_name: str, total: int, key: str, spin_s: float,
                  cpus: list[int] | None, local: bool = True) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    import torch.distributed as dist

    from nanovllm_tp.distributed.channel import ChannelClosed, PlanReader
    from nanovllm_tp.distributed.shm_ring import attach, fence

    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    mm = attach(ack_name)
    buf, off = memoryview(mm), (rank - 1) * _LINE
    secret = os.environ.get("NVTP_BENCH_SECRET")
    reader = PlanReader(store, rank, local, key=key, spin_s=spin_s, secret=secret.encode() if secret else None)
    try:
        for i in range(1, total + 1):
            reader.receive()
            t = time.perf_counter_ns()
            struct.pack_into("<Q", buf, off + 8, t)
            fence()
            struct.pack_into("<Q", buf, off, i)
        try:
            reader.receive(timeout=30)
        except ChannelClosed:
            pass
    finally:
        reader.close()
        buf.release()
        mm.close()


def _pct(sorted_vals: list[float], q: float) -> float:
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


def measure_broadcast_latency(payload_bytes: int = 20_000, readers: int = 2, iterations: int = 2000, *,
                              warmup: int = 200, gap_s: float = 0.0, spin_s: float = 0.05,
                              slot_bytes: int = 1 << 20, pin: bool = False, secure: bool = True,
                              remote: bool = False) -> dict:
    """Publish ``iterations`` plans of ``payload_bytes`` to ``readers`` reader processes (shared-memory
    readers, or ZMQ ones on loopback with ``remote``; CURVE-authenticated unless ``secure`` is False) and
    return latency statistics in microseconds (see the module docstring for the method)."""
    import torch.distributed as dist

    from nanovllm_tp.distributed.channel import PlanWriter
    from nanovllm_tp.distributed.shm_ring import fence
    from nanovllm_tp.distributed.trust import new_secret

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    key = f"bench_{secrets.token_hex(4)}"
    total = warmup + iterations
    ack = shared_memory.SharedMemory(name=f"nvtp_bench_{os.getpid()}_{secrets.token_hex(4)}",
                                     create=True, size=readers * _LINE)
    ncpu = len(os.sched_getaffinity(0))
    reader_cpus = sorted(os.sched_getaffinity(0))[1:] if pin and ncpu > 1 else None
    # Readers are fresh interpreters whose arguments travel as JSON on the command line (nothing pickled).
    commands = [[sys.executable, "-m", "nanovllm_tp.distributed.channel_bench", "--reader",
                 json.dumps([store.port, r, ack.name, total, key, spin_s, reader_cpus, not remote])]
                for r in range(1, readers + 1)]
    secret = new_secret() if secure else None
    env = dict(os.environ, NVTP_BENCH_SECRET=secret.decode()) if secure else os.environ
    old_affinity = os.sched_getaffinity(0)
    writer, procs = None, []
    try:
        for cmd in commands:
            procs.append(subprocess.Popen(cmd, env=env))
        if reader_cpus:
            os.sched_setaffinity(0, sorted(old_affinity)[:1])
        ranks = list(range(1, readers + 1))
        writer = PlanWriter(store, [] if remote else ranks, ranks if remote else [], slot_bytes=slot_bytes,
                            key=key, secret=secret)
        payload = os.urandom(payload_bytes)
        buf = ack.buf
        lat, pub = [], []
        for i in range(1, total + 1):
            t0 = time.perf_counter_ns()
            writer.publish(payload)
            t1 = time.perf_counter_ns()
            stamps = []
            for r in range(readers):
                waited = 0
                while _ACK.unpack_from(buf, r * _LINE)[0] != i:
                    os.sched_yield()  # spin, but let a reader sharing this core run
                    waited += 1
                    if waited % 100_000 == 0 and any(p.poll() is not None for p in procs):
                        raise RuntimeError("a benchmark reader process died")
                fence()
                stamps.append(_ACK.unpack_from(buf, r * _LINE)[1])
            if i > warmup:
                lat.append((max(stamps) - t0) / 1e3)
                pub.append((t1 - t0) / 1e3)
            if gap_s:
                time.sleep(gap_s)
        writer.shutdown("benchmark done")
        for p in procs:
            p.wait(timeout=30)
        lat.sort()
        pub.sort()
        return {"payload_bytes": payload_bytes, "readers": readers, "iterations": iterations,
                "median_us": statistics.median(lat), "p90_us": _pct(lat, 0.9), "p99_us": _pct(lat, 0.99),
                "mean_us": statistics.fmean(lat), "publish_median_us": statistics.median(pub),
                "cpus": ncpu, "pinned": bool(reader_cpus), "loadavg_1m": os.getloadavg()[0],
                "transport": "zmq" if remote else "shm", "authenticated": secure,
                "method": "one-way: writer stamp before publish -> last reader's stamp after receive"}
    finally:
        os.sched_setaffinity(0, old_affinity)
        if writer is not None:
            writer.close()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        ack.close()
        ack.unlink()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--reader":
        _bench_reader(*json.loads(sys.argv[2]))
    else:
        print(json.dumps(measure_broadcast_latency(readers=int(sys.argv[1]) if len(sys.argv) > 1 else 2),
                         indent=1))
