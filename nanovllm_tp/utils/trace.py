"""Step timeline of every rank as a Chrome / Perfetto trace (JSON trace-event format).

Call sites are one line each: ``with trace.span("forward"): ...``. While tracing is off ``span`` returns a
shared do-nothing context manager, so the cost is one global read and two empty method calls. While it is on,
each span appends ``(name, start_ns, end_ns, args)`` to this process's in-memory list; nothing touches a file
until the engine closes.

At close every rank > 0 writes its part next to the trace (``out.json.rank1`` ...; written to a temporary
name, then renamed, so a part is whole or absent) and rank 0 merges the parts it finds into ``out.json``,
waiting a bounded time for them: a rank that died leaves no part, and the log line says which ranks are
missing. Timestamps come from ``time.monotonic_ns``: CLOCK_MONOTONIC on Linux, one clock for every process of
a node, so the ranks' tracks line up. Ranks on other nodes have their own clock (and usually their own disk:
their parts stay there).

One traced engine per process (its spans go to this module's one buffer); spans of a TP = 1 engine running
beside it land in the same buffer.
"""
import json
import logging
import os
import time
from dataclasses import dataclass, field

log = logging.getLogger("nanovllm_tp")

MAX_EVENTS = 2_000_000          # per rank; spans beyond it are counted, not kept (a long serve stays bounded)
_KINDS = ("prefill", "decode", "mixed")
_now = time.monotonic_ns

enabled = False                 # read first by every span(): the whole cost of tracing when it is off
_events: list = []


class _Null:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _Null()


class _Span:
    __slots__ = ("name", "args", "t0")

    def __init__(self, name: str, args):
        self.name, self.args = name, args

    def __enter__(self):
        self.t0 = _now()
        return self

    def __exit__(self, *exc):
        if len(_events) < MAX_EVENTS:
            _events.append((self.name, self.t0, _now(), self.args))
        elif _recording is not None:
            _recording.dropped += 1
        return False


def span(name: str):
    """A timed region of this rank's track (a no-op while tracing is off)."""
    return _Span(name, None) if enabled else _NULL


def plan_span(name: str, plan):
    """A span that also names the step it ran (step id, kind, tokens, rows)."""
    if not enabled:
        return _NULL
    return _Span(name, (plan.step_id, plan.kind, plan.num_tokens, plan.num_rows))


@dataclass(slots=True)
class Recording:
    path: str
    rank: int
    world: int
    layers: bool
    started: float = field(default_factory=time.time)      # wall clock: parts older than this are stale
    dropped: int = 0
    hooks: list = field(default_factory=list)


_recording: Recording | None = None


def sibling_path(path: str, tag: str) -> str:
    """out.json -> out.TAG.json: where a second engine of the same run writes its trace."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.{tag}{ext or '.json'}"


def part_path(path: str, rank: int) -> str:
    return f"{path}.rank{rank}"


def start(config, rank: int) -> Recording | None:
    """Start recording this rank's spans when ``config.trace_path`` asks; None otherwise. Rank 0 removes stale
    parts of an earlier run first."""
    global enabled, _recording
    if not config.trace_path:
        return None
    if _recording is not None:
        raise ValueError(f"this process already traces an engine into {_recording.path!r}: close it first "
                         "(one traced engine per process)")
    world = config.world_size
    if rank == 0:
        for r in range(1, world):
            _remove(part_path(config.trace_path, r))
    _recording = Recording(config.trace_path, rank, world, config.trace_layers)
    _events.clear()
    enabled = True
    return _recording


def watch_layers(model) -> None:
    """With trace_layers, a span per decoder layer (``layer.N``) through forward hooks: nothing is added to
    the model code, and nothing runs when layer tracing is off. On CUDA each layer ends with a synchronize, so
    the span is the layer's device time (CUDA graph replays run no hooks: use enforce_eager)."""
    rec = _recording
    if rec is None or not rec.layers:
        return
    import torch
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else None
    for name, module in model.named_modules():
        head, _, index = name.rpartition(".")
        if not (head.endswith("layers") and index.isdigit()):
            continue
        before, after = _layer_hooks(f"layer.{index}", sync)
        rec.hooks += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


def _layer_hooks(label: str, sync):
    open_spans = []

    def before(module, inputs):
        if sync is not None:
            sync()
        open_spans.append(span(label).__enter__())

    def after(module, inputs, output):
        if sync is not None:
            sync()
        if open_spans:
            open_spans.pop().__exit__(None, None, None)

    return before, after


def finish(rec: Recording | None, wait_s: float = 10.0) -> str | None:
    """Stop recording and write: rank > 0 its part, rank 0 the merged trace (waiting up to ``wait_s`` for the
    other ranks' parts). Returns the path written. Never raises: a trace must not turn a clean close into a
    failure."""
    global enabled, _recording
    if rec is None or rec is not _recording:
        return None
    enabled, _recording = False, None
    events = _rank_events(rec, list(_events))
    _events.clear()
    for hook in rec.hooks:
        hook.remove()
    try:
        if rec.rank:
            _write(part_path(rec.path, rec.rank), {"rank": rec.rank, "traceEvents": events})
            return part_path(rec.path, rec.rank)
        return _merge(rec, events, wait_s)
    except Exception:
        log.exception("writing the trace of rank %d failed", rec.rank)
        return None


def _rank_events(rec: Recording, raw: list) -> list[dict]:
    pid = rec.rank + 1      # pid 0 means "no process" to some viewers
    name = "rank 0 (scheduler + model)" if rec.rank == 0 else f"rank {rec.rank}"
    out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": pid, "args": {"name": name}},
           {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": pid, "args": {"sort_index": rec.rank}},
           {"ph": "M", "name": "thread_name", "pid": pid, "tid": pid, "args": {"name": "engine"}}]
    for label, t0, t1, args in raw:
        event = {"name": label, "ph": "X", "ts": t0 / 1e3, "dur": (t1 - t0) / 1e3, "pid": pid, "tid": pid}
        if args is not None:
            step, kind, tokens, rows = args
            event["args"] = {"step": step, "kind": _KINDS[kind] if 0 <= kind < 3 else kind, "tokens": tokens,
                             "rows": rows}
        out.append(event)
    if rec.dropped:
        log.warning("trace: rank %d dropped %d spans beyond %d", rec.rank, rec.dropped, MAX_EVENTS)
    return out


def _merge(rec: Recording, events: list[dict], wait_s: float) -> str:
    """Rank 0: its own events plus every part that arrives within wait_s; parts are removed once merged."""
    pending = {r: part_path(rec.path, r) for r in range(1, rec.world)}
    deadline = time.monotonic() + wait_s
    while True:
        for r, path in list(pending.items()):
            part = _read_part(path, rec.started)
            if part is not None:
                events += part
                _remove(path)
                del pending[r]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if pending:
        log.warning("trace: no part from rank(s) %s (the rank died, or its disk is not this one's: look for %s); "
                    "%s holds the others", sorted(pending), ", ".join(pending.values()), rec.path)
    origin = min((e["ts"] for e in events if e["ph"] == "X"), default=0.0)
    for e in events:
        if e["ph"] == "X":
            e["ts"] = round(e["ts"] - origin, 3)
            e["dur"] = round(e["dur"], 3)
    _write(rec.path, {"traceEvents": events, "displayTimeUnit": "ms",
                      "otherData": {"ranks": rec.world, "missing_ranks": sorted(pending)}})
    log.info("trace written to %s (open it in https://ui.perfetto.dev)", rec.path)
    return rec.path


def _read_part(path: str, not_before: float) -> list[dict] | None:
    """A part written by this run (not a stale one of an earlier run), or None."""
    try:
        if os.stat(path).st_mtime < not_before - 1.0:
            return None
        with open(path) as f:
            return json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, separators=(",", ":"))
        os.replace(tmp, path)
    finally:
        _remove(tmp)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
