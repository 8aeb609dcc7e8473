"""How busy each pipeline stage was, and how much of the time the stages computed at once, read from an engine
trace (`--trace OUT.json`, the merged Chrome trace of every rank).

    python -m nanovllm_tp.bench.stage_overlap OUT.json [--tp 1]

A rank counts as busy while it runs a "forward" span (its layers; not the waits for activations, logits or plans).
The window is steady decode: from the start of rank 0's first decode step to the end of its last one (rank 0 runs
stage 0 of every step, so its execute spans carry each step's kind). Reported per stage (its first TP rank): the
share of the window it computed; and the share in which every stage computed at once. With one step in flight the
stages take turns, so the share of all at once is about 0; with a micro-batch per stage it approaches the
smallest stage's share.
"""
from __future__ import annotations

import argparse
import json


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _clip(intervals, lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def stage_overlap(events: list[dict], tp: int = 1) -> dict:
    """From a merged trace's events: {"window_ms", "decode_steps", "busy" (per stage, share of the window),
    "all_busy" (share with every stage computing at once)}. Stage s is read from rank s * tp (pid = rank + 1)."""
    spans = [e for e in events if e.get("ph") == "X"]
    ranks = sorted({e["pid"] - 1 for e in spans})
    stages = [r for r in ranks if r % tp == 0]
    decode = [e for e in spans if e["pid"] == 1 and e["name"] == "execute"
              and e.get("args", {}).get("kind") == "decode"]
    if len(stages) < 2 or not decode:
        raise ValueError(f"the trace needs at least two pipeline stages and decode steps (ranks {ranks}, "
                         f"{len(decode)} decode steps of rank 0)")
    lo = min(e["ts"] for e in decode)
    hi = max(e["ts"] + e["dur"] for e in decode)
    busy = {r: _clip(_union([(e["ts"], e["ts"] + e["dur"]) for e in spans
                             if e["pid"] == r + 1 and e["name"] == "forward"]), lo, hi) for r in stages}
    together = busy[stages[0]]
    for r in stages[1:]:
        together = _intersect(together, busy[r])
    window = hi - lo
    return {"window_ms": window / 1e3, "decode_steps": len(decode),
            "busy": {str(r // tp): _length(busy[r]) / window for r in stages},
            "all_busy": _length(together) / window}


def read(path: str, tp: int = 1) -> dict:
    with open(path) as f:
        data = json.load(f)
    return stage_overlap(data["traceEvents"] if isinstance(data, dict) else data, tp)


def describe(result: dict) -> str:
    stages = ", ".join(f"stage {s} {share:.0%}" for s, share in result["busy"].items())
    return (f"steady decode {result['window_ms']:.0f} ms ({result['decode_steps']} steps): computing {stages}; "
            f"every stage at once {result['all_busy']:.0%}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="a merged engine trace (the engine's trace_path)")
    parser.add_argument("--tp", type=int, default=1, help="the run's tensor_parallel_size (stages are TP ranks "
                                                          "apart)")
    args = parser.parse_args(argv)
    result = read(args.trace, args.tp)
    print(describe(result))
    return result


if __name__ == "__main__":
    main()
