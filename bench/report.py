"""What a benchmark reports: summary statistics (median, interpolated percentiles), the JSON result (written
atomically, default path results/<name>-<timestamp>.json), a plain-text table, an optional matplotlib plot, and
progress lines on stderr (silenced by --quiet; the line that says where the result went stays)."""
from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import statistics
import sys


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(xs: list[float]) -> dict:
    """mean, p50, p90, p99 (plus min/max/count) of a list; None fields when it is empty."""
    xs = [x for x in xs if x is not None]
    return {"count": len(xs), "mean": statistics.fmean(xs) if xs else None, "p50": percentile(xs, 50),
            "p90": percentile(xs, 90), "p99": percentile(xs, 99), "min": min(xs) if xs else None,
            "max": max(xs) if xs else None}


def default_out_path(name: str) -> pathlib.Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return pathlib.Path("results") / f"{name}-{stamp}.json"


def write_json(path, data: dict) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def fmt(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isinf(x) or math.isnan(x):
            return str(x)
        return f"{x:,.{digits}f}"
    return str(x)


def format_table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row):   # first column left-aligned (labels), the rest right-aligned (numbers)
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    rule = "-" * len(line(cells[0]))
    out = ([title] if title else []) + [rule, line(cells[0]), rule] + [line(r) for r in cells[1:]] + [rule]
    return "\n".join(out)


def plot_path(args, out_path: pathlib.Path) -> pathlib.Path | None:
    if args.plot is None:
        return None
    return pathlib.Path(args.plot) if args.plot else out_path.with_suffix(".png")


def save_plot(path: pathlib.Path | None, draw) -> str | None:
    """Call draw(plt) and save the figure to `path`; returns the path, or None (with a message) without
    matplotlib. The figure is made with the Agg backend, so no display is needed."""
    if path is None:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed, no plot written "
              "(pip install matplotlib, or pip install -e '.[plot]')", file=sys.stderr)
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = draw(plt)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def save_result(args, out_path: pathlib.Path, result: dict, draw) -> dict:
    """The PNG (with --plot), then the JSON; result gains "plot" and "out"."""
    png = save_plot(plot_path(args, out_path), draw(result))
    if png:
        result["plot"] = png
    write_json(out_path, result)
    result["out"] = str(out_path)
    say_written(out_path, png)
    return result


def say_written(*paths) -> None:
    """The line that says where a benchmark wrote its result (--quiet too), each path absolute: the default,
    results/, is under whatever directory the benchmark ran in."""
    where = " and ".join(str(pathlib.Path(p).resolve()) for p in paths if p)
    print(f"results: {where}", file=sys.stderr, flush=True)


def log(args, msg: str) -> None:
    if not getattr(args, "quiet", False):
        print(msg, file=sys.stderr, flush=True)
