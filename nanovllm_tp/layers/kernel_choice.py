"""The fastest linear kernel for each weight shape and row count on this CPU (packed_linear="auto").

Which matmul wins depends on the CPU and the shape: on an AVX-512 BF16 machine without AMX csrc/linear.c wins
bf16 at every decode row count, while oneDNN with AMX tiles wins by 1.5x from ~16 rows up and loses at one row.
So at load each distinct weight shape (per dtype) times the candidates that can run it per row-count bucket
(kernel_timing.py). The winner per (shape, bucket) is kept in a ChosenWeight, and a step picks its kernel by the
bucket of its row count (a table lookup). A layout is packed only for the kernels that win somewhere: both where
both win, which `extra_bytes` reports.

The table (kernel_table.py) is cached as JSON beside the compiled kernels, one file per dtype under a key of the
CPU model and flags, the kernels' sources, the choice's own files, torch's version (oneDNN's), the thread count
and the candidates: a later load reuses it; another CPU, source version or candidate set measures afresh. Shapes
a file lacks are measured and added. A shape whose timings other processes spoiled twice is cached too, as
disturbed (the first candidate in every bucket): a later load measures it again only when it finds the cores
quiet (under QUIET_CORES of other processes' work), so that a busy machine pays for the timings once.

A kernel joins with one `register(name, can_run, pack, run)` (packed_linear.py registers "c" and "onednn"). The
candidates of a weight are those whose can_run accepts it, so a quantized kernel registers with a can_run that
accepts only QuantBlocks of its types, and competes with the other kernels of those types (pack_cpu_weights
hands block weights here once a type has two kernels: quant.py has one per type today).
"""
import hashlib
import logging
import pathlib
import time
from dataclasses import dataclass
from typing import Callable

import torch

from nanovllm_tp.config import cpu_threads
from nanovllm_tp.layers import cpu_build, cpu_features, kernel_table, kernel_timing
from nanovllm_tp.layers.kernel_table import (BUCKETS, TIMED_ROWS, ShapeChoice, bucket, cached_choice, entry_of,
                                             read_table, summary, write_table)
from nanovllm_tp.layers.kernel_timing import COPY_BYTES, disturbed, measure, winners_of

__all__ = ["BUCKETS", "TIMED_ROWS", "Candidate", "CANDIDATES", "ChosenWeight", "ShapeChoice", "bucket", "cache_path",
           "choose", "disturbed", "measure", "read_table", "register", "report", "summary", "table_of",
           "table_of_chosen", "winners_of", "write_table"]

log = logging.getLogger("nanovllm_tp")
_OWN_FILES = tuple(pathlib.Path(m.__file__) for m in (kernel_table, kernel_timing)) + (pathlib.Path(__file__),)

INVARIANT = "c"            # the kernel whose every row is the same sum at any row count (csrc/linear.c)
# The table an Intel Xeon with AMX measures (csrc/linear.c up to 8 rows, oneDNN's AMX tiles from 9): the
# packed_linear="c+onednn" knob forces it on any CPU where both kernels run, so that the kernel paths such a CPU
# takes (the fused C decode layers for small batches, the modules through oneDNN for large ones and for prefill)
# are exercised on every machine.
AMX_TABLE = ("c", "c", "c", "onednn", "onednn", "onednn", "onednn")
QUIET_CORES = 0.25         # other processes' cores in use under which a load measures a disturbed shape again


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
    """The table file of this CPU, source version, torch, thread count and candidate set for dtype. The candidates
    register when their modules are imported (packed_linear.py): before that the key would name another file."""
    if not CANDIDATES:
        raise RuntimeError("no linear kernel has registered yet: import nanovllm_tp.layers.packed_linear first")
    parts = [cpu_features.cpu_model(), cpu_features.flags_line(), torch.__version__, str(torch.get_num_threads()),
             " ".join(sorted(CANDIDATES)), *(f.read_bytes().hex() for f in (*cpu_build.SOURCES,
                                                                            *cpu_build.HEADERS, *_OWN_FILES))]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return cpu_build.cache_dir() / f"kernel-choice-{str(dtype).removeprefix('torch.')}-{key}.json"


def choose(weights: list[torch.Tensor], row_invariant: bool = False,
           fixed: tuple[str, ...] | None = None) -> dict[int, ChosenWeight | None]:
    """For each dense weight (one rank's linear layers and LM head), by id: its ChosenWeight, or None where no
    candidate runs it (F.linear). Tables read from the cache, or measured and added to it; `fixed` (a winner per
    bucket, e.g. AMX_TABLE) instead of either: nothing measured, a bucket whose kernel cannot run a weight takes
    the first candidate that can. With row_invariant
    (speculative decoding) a weight the C kernel runs takes it in every decode bucket (up to 64 rows) whatever
    the table says: it computes each row alike at any row count, so a verify step's 1 + k rows agree with each
    other whatever k is (oneDNN's bf16 sums do not: its rounding flips near ties between the buckets). The
    prefill bucket (over 64 rows) keeps the table's winner, as an engine without speculation does. Where the
    table's winner at one row or up to 64 is not the C kernel, an engine without speculation rounds its decode
    rows and its short prompts (64 tokens or fewer) otherwise, so the two agree on tokens only under
    batch_invariant (docs/features.md)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for w in weights:
        groups.setdefault((tuple(w.shape), w.dtype), []).append(w)
    copy_bytes = min(COPY_BYTES, sum(w.nbytes for w in weights))
    out, tables, started, measuring, quiet = {}, {}, time.perf_counter(), False, None
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
        if choice is None and fixed is not None:
            choice = ShapeChoice(shape, dname, tuple(n if n in names else names[0] for n in fixed), {})
        if choice is None:
            choice = cached_choice(shapes.get(f"{shape[0]}x{shape[1]}"), names, shape, dname)
            if choice is not None and choice.disturbed:
                if quiet is None:
                    quiet = cpu_threads.others_busy() < QUIET_CORES
                if quiet:
                    choice = None          # spoiled last time, and the cores are quiet now: measured again
        if choice is None:
            if not measuring:
                measuring = True
                cpu_build.first_run_notice("measuring the linear kernels on this CPU once per model shape (a few "
                                           f"seconds; cached in {path.parent})...")
            choice = measure(cands, ws, copy_bytes)
            shapes[choice.key] = entry_of(choice)
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
