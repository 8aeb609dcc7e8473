"""The fastest linear kernel for each weight shape and row count on this CPU (packed_linear="auto").

Which matmul wins depends on the CPU and the shape: on an AVX-512 BF16 machine without AMX csrc/linear.c wins
bf16 at every decode row count, while oneDNN with AMX tiles wins by 1.5x from ~16 rows up and loses at one row.
So at load each distinct weight shape (per dtype) times the candidates that can run it at one row count per
bucket (BUCKETS; TIMED_ROWS, each bucket's largest count, 256 for a prefill), a few milliseconds each (the
median call of a round, the best of rounds that alternate the candidates), over distinct packed copies of the model's own weights (enough
to exceed the last-level cache where the model does, so that they come from memory as in a real step). The
winner per (shape, bucket) is kept in a ChosenWeight, and a step picks its kernel by the bucket of its row count
(a table lookup). A layout is packed only for the kernels that win somewhere: both where both win, which
`extra_bytes` reports.

The table is cached as JSON beside the compiled kernels, one file per dtype under a key of the CPU model and
flags, the kernels' sources, this file, torch's version (oneDNN's), the thread count and the candidates: a later
load reuses it; another CPU, source version or candidate set measures afresh. Shapes a file lacks are measured
and added.

A kernel joins with one `register(name, can_run, pack, run)` (linear.py registers "c" and "onednn"). The
candidates of a weight are those whose can_run accepts it, so a quantized kernel registers with a can_run that
accepts only QuantBlocks of its types, and competes with the other kernels of those types (pack_cpu_weights
hands block weights here once a type has two kernels: quant.py has one per type today).
"""
import hashlib
import json
import logging
import math
import os
import pathlib
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch

from nanovllm_tp.layers import cpu_features, cpu_kernels

log = logging.getLogger("nanovllm_tp")

BUCKETS = ("1", "2-4", "5-8", "9-16", "17-32", "33-64", ">64")
TIMED_ROWS = (1, 4, 8, 16, 32, 64, 256)
_BUCKET_OF = bytes(next(i for i, top in enumerate(TIMED_ROWS) if rows <= top) for rows in range(65)) + b"\x06"
ROUNDS, ROUND_SECONDS, MIN_CALLS = 5, 0.0006, 1   # per (shape, bucket, candidate): >= 3 ms, >= 5 calls
COPY_BYTES, MAX_COPIES = 64 << 20, 64       # distinct packed copies timed: up to this many bytes (the model's own)
BUCKET_SECONDS = 0.1      # past this, a bucket's timing stops after two rounds
INVARIANT = "c"            # the kernel whose every row is the same sum at any row count (csrc/linear.c)
MARGIN = 0.10              # what a second candidate must win a bucket by to be kept beside the first


def bucket(rows: int) -> int:
    """The index in BUCKETS of a step's row count."""
    return _BUCKET_OF[rows if rows < 65 else 65]


@dataclass(slots=True, frozen=True)
class Candidate:
    """A kernel for linear layers: can_run(w) says whether it runs weight w here (a dense [out, in] tensor, or a
    layer's QuantBlocks), pack(w) makes its packed form, run(x, packed, bias) computes x @ w.T (+ bias) for a
    2-D x in w's dtype."""
    name: str
    can_run: Callable
    pack: Callable
    run: Callable


CANDIDATES: dict[str, Candidate] = {}


def register(name: str, can_run: Callable, pack: Callable, run: Callable) -> Candidate:
    CANDIDATES[name] = Candidate(name, can_run, pack, run)
    return CANDIDATES[name]


@dataclass(slots=True)
class ShapeChoice:
    """One weight shape's table: the winner per bucket, the median microseconds per call of every candidate
    timed (empty where one candidate could run it), whether it came from the cache, and the bytes of the
    layouts kept beyond one (summed over the layers of the shape)."""
    shape: tuple[int, int]
    dtype: str
    winners: tuple[str, ...]
    micros: dict[str, list[float]]
    cached: bool = False
    extra_bytes: int = 0
    disturbed: bool = False      # timings other processes spoiled: the first candidate everywhere, not cached

    @property
    def key(self) -> str:
        return f"{self.shape[0]}x{self.shape[1]}"

    def kept(self) -> list[str]:
        return list(dict.fromkeys(self.winners))

    def rows(self) -> list[dict]:
        """One row per bucket: shape, dtype, bucket, winner, us (each candidate's median µs per call)."""
        return [{"shape": self.key, "dtype": self.dtype, "bucket": name, "winner": self.winners[b],
                 "us": {c: round(t[b], 1) for c, t in self.micros.items()}} for b, name in enumerate(BUCKETS)]


@dataclass(slots=True)
class ChosenWeight:
    """A weight packed for each kernel that wins one of its buckets; calling it runs the bucket's winner."""
    forms: tuple
    runs: tuple
    pick: bytes                  # bucket -> index into forms
    choice: ShapeChoice

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        i = self.pick[bucket(x.shape[0])]
        return self.runs[i](x, self.forms[i], bias)


def cache_path(dtype: torch.dtype) -> pathlib.Path:
    """The table file of this CPU, source version, torch, thread count and candidate set for dtype."""
    here = pathlib.Path(__file__)
    parts = [cpu_features.cpu_model(), cpu_features.flags_line(), torch.__version__, str(torch.get_num_threads()),
             " ".join(sorted(CANDIDATES)), *(f.read_bytes().hex() for f in (*cpu_kernels.SOURCES,
                                                                            *cpu_kernels.HEADERS, here))]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return cpu_kernels.cache_dir() / f"kernel-choice-{str(dtype).removeprefix('torch.')}-{key}.json"


def read_table(path: pathlib.Path) -> dict:
    """{shape key: {"winners": [...], "us": {...}}} from a table file; {} where it is missing or unreadable."""
    try:
        shapes = json.loads(path.read_text()).get("shapes", {})
        return shapes if isinstance(shapes, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}


def write_table(path: pathlib.Path, shapes: dict) -> None:
    """Atomically (ranks may write at once; each installs a whole file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"cpu": cpu_features.cpu_model(), "amx": cpu_features.amx(), "threads": torch.get_num_threads(),
            "buckets": BUCKETS, "timed_rows": TIMED_ROWS, "shapes": shapes}
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(body, f, indent=1)
    os.replace(f.name, path)


def _cached(entry, names: list[str], shape, dtype: str) -> ShapeChoice | None:
    try:
        winners = tuple(entry["winners"])
        micros = {c: [float(t) for t in ts] for c, ts in entry["us"].items()}
    except (KeyError, TypeError, ValueError):
        return None
    if len(winners) != len(BUCKETS) or not set(winners) <= set(names):
        return None
    return ShapeChoice(shape, dtype, winners, micros, cached=True)


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
    for attempt in range(2):
        micros = {c.name: [] for c in cands}
        for rows in TIMED_ROWS:
            for name, ns in _time_bucket(cands, forms, rows, w.shape[1], w.dtype).items():
                micros[name].append(ns / 1e3)
        if not disturbed(micros, w.nbytes):
            return ShapeChoice(tuple(w.shape), str(w.dtype).removeprefix("torch."), winners_of(micros), micros)
    log.warning("kernel timings of a %dx%d weight were disturbed twice (other processes on the cores?): it runs "
                "%s in every bucket, and is measured again at the next load", *w.shape, cands[0].name)
    return ShapeChoice(tuple(w.shape), str(w.dtype).removeprefix("torch."), (cands[0].name,) * len(BUCKETS), micros,
                       disturbed=True)


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


def choose(weights: list[torch.Tensor], row_invariant: bool = False) -> dict[int, ChosenWeight | None]:
    """For each dense weight (one rank's linear layers and LM head), by id: its ChosenWeight, or None where no
    candidate runs it (F.linear). Tables read from the cache, or measured and added to it. With row_invariant
    (speculative decoding) a weight the C kernel runs takes it in every decode bucket (up to 64 rows) whatever
    the table says: it computes each row alike at any row count, so a verify step's 1 + k rows get the logits
    that plain decoding's one row gets (oneDNN's bf16 sums do not: its rounding flips near ties between the
    buckets). The prefill bucket keeps the table's winner, as an engine without speculation does, so that both
    write the same KV for a prompt."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for w in weights:
        groups.setdefault((tuple(w.shape), w.dtype), []).append(w)
    copy_bytes = min(COPY_BYTES, sum(w.nbytes for w in weights))
    out, tables, started = {}, {}, time.perf_counter()
    for (shape, dtype), ws in groups.items():
        cands = [c for c in CANDIDATES.values() if c.can_run(ws[0])]
        if not cands:
            out.update((id(w), None) for w in ws)
            continue
        dname = str(dtype).removeprefix("torch.")
        if dtype not in tables:
            tables[dtype] = [cache_path(dtype), None, False]       # path, shapes read, changed
            tables[dtype][1] = read_table(tables[dtype][0])
        path, shapes, _ = tables[dtype]
        names = [c.name for c in cands]
        choice = None if len(cands) > 1 else ShapeChoice(shape, dname, (names[0],) * len(BUCKETS), {})
        if choice is None:
            choice = _cached(shapes.get(f"{shape[0]}x{shape[1]}"), names, shape, dname)
        if choice is None:
            choice = measure(cands, ws, copy_bytes)
            if not choice.disturbed:
                shapes[choice.key] = {"winners": choice.winners, "us": choice.micros}
                tables[dtype][2] = True
        if row_invariant and INVARIANT in names:
            choice = ShapeChoice(shape, dname, (INVARIANT,) * (len(BUCKETS) - 1) + choice.winners[-1:],
                                 choice.micros, choice.cached, disturbed=choice.disturbed)
        kept = [CANDIDATES[n] for n in choice.kept()]
        pick = bytes(choice.kept().index(n) for n in choice.winners)
        for w in ws:
            forms = tuple(c.pack(w) for c in kept)
            choice.extra_bytes += sum(f.nbytes if isinstance(f, torch.Tensor) else f.data.nbytes for f in forms[1:])
            out[id(w)] = ChosenWeight(forms, tuple(c.run for c in kept), pick, choice)
    for path, shapes, changed in tables.values():
        if changed:
            try:
                write_table(path, shapes)
            except OSError as e:
                log.warning("could not cache the kernel table in %s: %s", path, e)
    _log_table(table_of_chosen(out.values()), time.perf_counter() - started)
    return out


def table_of_chosen(packed) -> list[ShapeChoice]:
    return list({id(p.choice): p.choice for p in packed if isinstance(p, ChosenWeight)}.values())


def table_of(model: torch.nn.Module) -> list[ShapeChoice]:
    """The tables of the model's ChosenWeights, one per shape."""
    return table_of_chosen(getattr(m, "packed", None) for m in model.modules())


def summary(table: list[ShapeChoice]) -> str:
    """One line: winners counted over (shape, bucket), shapes that keep two layouts, their extra memory."""
    wins = {}
    for choice in table:
        for w in choice.winners:
            wins[w] = wins.get(w, 0) + 1
    both = [c for c in table if len(c.kept()) > 1]
    extra = sum(c.extra_bytes for c in table)
    counts = ", ".join(f"{n} {k}/{len(table) * len(BUCKETS)}" for n, k in sorted(wins.items()))
    return f"{counts}; {len(both)} of {len(table)} shapes keep two layouts (+{extra / 2**20:.1f} MiB)"


def _log_table(table: list[ShapeChoice], seconds: float) -> None:
    from nanovllm_tp.distributed.parallel_state import tp_rank
    if not table or tp_rank() != 0:
        return
    timed = [c for c in table if c.micros and not c.cached]
    log.info("linear kernels per bucket %s (%s; %d shapes measured in %.1f s, amx %s): %s", "/".join(BUCKETS),
             summary(table), len(timed), seconds, cpu_features.amx(), "; ".join(
                 f"{c.dtype} {c.key}: " + " ".join(
                     f"{w}" + (f"({min(t[b] for t in c.micros.values()):.0f}us)" if c.micros else "")
                     for b, w in enumerate(c.winners)) for c in table))


def report(model: torch.nn.Module) -> dict | None:
    """LLM.stats()'s linear_kernels: the table (one row per shape and bucket), the bytes of second layouts,
    whether AMX tiles may run here; None where no weight went through the choice."""
    table = table_of(model)
    if not table:
        return None
    return {"table": [row for choice in table for row in choice.rows()],
            "disturbed": [c.key for c in table if c.disturbed],
            "extra_bytes": sum(c.extra_bytes for c in table), "cached": all(c.cached or not c.micros for c in table),
            "amx": cpu_features.amx(), "summary": summary(table)}
