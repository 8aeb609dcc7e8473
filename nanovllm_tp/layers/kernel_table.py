"""The kernel table's shapes: row-count buckets (BUCKETS; TIMED_ROWS, the count timed for each), one weight shape's
winners and timings (ShapeChoice), the JSON file they are cached in (read_table, write_table) and its one-line
summary. kernel_choice.py fills it; kernel_timing.py measures it."""
import json
import os
import pathlib
import tempfile
from dataclasses import dataclass

import torch

from nanovllm_tp.layers import cpu_features

BUCKETS = ("1", "2-4", "5-8", "9-16", "17-32", "33-64", ">64")
TIMED_ROWS = (1, 4, 8, 16, 32, 64, 256)
_BUCKET_OF = bytes(next(i for i, top in enumerate(TIMED_ROWS) if rows <= top) for rows in range(65)) + b"\x06"


def bucket(rows: int) -> int:
    """The index in BUCKETS of a step's row count."""
    return _BUCKET_OF[rows if rows < 65 else 65]


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
    disturbed: bool = False      # timings other processes spoiled: the first candidate everywhere, cached as such

    @property
    def key(self) -> str:
        return f"{self.shape[0]}x{self.shape[1]}"

    def kept(self) -> list[str]:
        return list(dict.fromkeys(self.winners))

    def rows(self) -> list[dict]:
        """One row per bucket: shape, dtype, bucket, winner, us (each candidate's median µs per call)."""
        return [{"shape": self.key, "dtype": self.dtype, "bucket": name, "winner": self.winners[b],
                 "us": {c: round(t[b], 1) for c, t in self.micros.items()}} for b, name in enumerate(BUCKETS)]


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


def cached_choice(entry, names: list[str], shape, dtype: str) -> ShapeChoice | None:
    """A table file's entry for one shape, if it is whole and names only these candidates."""
    try:
        winners = tuple(entry["winners"])
        micros = {c: [float(t) for t in ts] for c, ts in entry["us"].items()}
    except (KeyError, TypeError, ValueError):
        return None
    if len(winners) != len(BUCKETS) or not set(winners) <= set(names):
        return None
    return ShapeChoice(shape, dtype, winners, micros, cached=True, disturbed=entry.get("disturbed") is True)


def entry_of(choice: ShapeChoice) -> dict:
    """A measured shape's entry in the table file."""
    return {"winners": choice.winners, "us": choice.micros, **({"disturbed": True} if choice.disturbed else {})}


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
