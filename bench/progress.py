"""A benchmark's progress while LLM.generate runs: one plain line on stderr every few seconds (requests done of the
total, seconds so far, the prompt and decode rates so far), where a terminal bar would garble a log file. Given to
generate as its use_tqdm (a callable that makes a bar, as vLLM takes it); the work timed is the same, the cost one
clock read per step."""
import sys
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class ProgressLines:
    total: int
    desc: str = ""
    every: float = 5.0            # seconds between lines
    label: str = ""               # what the line names first (default: desc)
    done: int = 0
    fields: dict = field(default_factory=dict)
    start: float = field(default_factory=time.perf_counter)
    last: float = field(default_factory=time.perf_counter)

    def update(self, n: int = 1) -> None:
        """n more requests done; a line when `every` seconds have passed since the last."""
        self.done += n
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            print(self.line(now), file=sys.stderr, flush=True)

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **fields) -> None:
        """tqdm's: the fields shown after the count (here, the rates)."""
        self.fields = {**(ordered_dict or {}), **fields}

    def line(self, now: float | None = None) -> str:
        seconds = (time.perf_counter() if now is None else now) - self.start
        extra = "".join(f", {k} {v}" for k, v in self.fields.items())
        return f"{self.label or self.desc}: {self.done}/{self.total} requests done, {seconds:.0f} s{extra}"

    def close(self) -> None:
        pass


def progress_lines(args, label: str, every: float = 5.0):
    """The use_tqdm of a benchmark's generate: progress lines named `label`, or False with --quiet."""
    if getattr(args, "quiet", False):
        return False
    return lambda total, desc: ProgressLines(total, desc, every=every, label=label)
