"""Timing the linear kernels that can run one weight shape, per row-count bucket, at load.

Each candidate runs at one row count per bucket (kernel_table.TIMED_ROWS; 256 for a prefill), a few milliseconds
each (the median call of a round, the best of rounds that alternate the candidates), over distinct packed copies
of the model's own weights (enough to exceed the last-level cache where the model does, so that they come from
memory as in a real step). Timings other processes evidently spoiled are taken again, then kept as disturbed (kernel_choice.py)."""
from __future__ import annotations

import logging
import math
import statistics
import time
from typing import TYPE_CHECKING

import torch

from nanovllm_tp.layers.kernel_table import BUCKETS, TIMED_ROWS, ShapeChoice

if TYPE_CHECKING:
    from nanovllm_tp.layers.kernel_choice import Candidate

log = logging.getLogger("nanovllm_tp")

ROUNDS, ROUND_SECONDS, MIN_CALLS = 5, 0.0006, 1   # per (shape, bucket, candidate): >= 3 ms, >= 5 calls
COPY_BYTES, MAX_COPIES = 64 << 20, 64       # distinct packed copies timed: up to this many bytes (the model's own)
BUCKET_SECONDS = 0.1      # past this, a bucket's timing stops after two rounds
MARGIN = 0.10              # what a second candidate must win a bucket by to be kept beside the first


def _time_bucket(cands: list[Candidate], forms: dict[str, list], rows: int, k: int, dtype) -> dict[str, float]:
    """ns per call of each candidate at `rows` rows: the median call of a round, the best of ROUNDS rounds that
    alternate the candidates (a round that other processes preempted does not decide), each call on the next
    distinct copy."""
    x = torch.randn(rows, k).to(dtype)
    best = {c.name: math.inf for c in cands}
    for c in cands:
        c.run(x, forms[c.name][0], None)     # warm: first-call setup out of the figures
    nxt, started = 1, time.perf_counter()
    for r in range(ROUNDS):
        if r >= 2 and time.perf_counter() - started > BUCKET_SECONDS:     # slow calls (an LM head's prefill)
            break
        for c in cands:
            copies, times = forms[c.name], []
            end = time.perf_counter() + ROUND_SECONDS
            while len(times) < MIN_CALLS or time.perf_counter() < end:
                start = time.perf_counter_ns()
                c.run(x, copies[(nxt + len(times)) % len(copies)], None)
                times.append(time.perf_counter_ns() - start)
            best[c.name] = min(best[c.name], statistics.median(times))
        nxt += len(times)
    return best


def measure(cands: list[Candidate], weights: list[torch.Tensor], copy_bytes: int) -> ShapeChoice:
    """Time cands on packed copies of weights (one shape): as many as fit in copy_bytes, at least one."""
    w = weights[0]
    count = max(1, min(MAX_COPIES, math.ceil(copy_bytes / max(1, w.nbytes))))
    forms = {c.name: [c.pack(weights[i % len(weights)]) for i in range(count)] for c in cands}
    shape, dtype = tuple(w.shape), str(w.dtype).removeprefix("torch.")
    for attempt in range(2):
        micros = {c.name: [] for c in cands}
        for rows in TIMED_ROWS:
            for name, ns in _time_bucket(cands, forms, rows, w.shape[1], w.dtype).items():
                micros[name].append(ns / 1e3)
        if not disturbed(micros, w.nbytes):
            return ShapeChoice(shape, dtype, winners_of(micros), micros)
    log.warning("kernel timings of a %dx%d weight were disturbed twice (other processes on the cores?): it runs "
                "%s in every bucket, and is measured again at a load that finds the cores quiet", *w.shape, cands[0].name)
    return ShapeChoice(shape, dtype, (cands[0].name,) * len(BUCKETS), micros, disturbed=True)


def disturbed(micros: dict[str, list[float]], weight_bytes: int) -> bool:
    """Whether other work evidently ran over the timing: a kernel over 3x slower at some bucket than at the next
    larger one (a call costs more with more rows), or slower at one row than reading the weight at 1 GB/s."""
    return any(t[b] > 3 * t[b + 1] for t in micros.values() for b in range(len(t) - 1)) or any(
        t[0] > weight_bytes / 1e3 + 1e3 for t in micros.values())


def winners_of(micros: dict[str, list[float]]) -> tuple[str, ...]:
    """Per bucket the fastest candidate, unless it beats the one fastest in most buckets by less than MARGIN: a
    second layout costs the weight's memory again and must win by more than noise."""
    names, buckets = list(micros), range(len(BUCKETS))
    fastest = [min(names, key=lambda n: micros[n][b]) for b in buckets]
    main = max(names, key=lambda n: (fastest.count(n), -sum(micros[n])))
    return tuple(f if micros[f][b] < micros[main][b] * (1 - MARGIN) else main for b, f in zip(buckets, fastest))
