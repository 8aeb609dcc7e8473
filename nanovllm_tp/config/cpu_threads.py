"""A CPU rank's thread count where nothing fixes it (no --threads, no OMP_NUM_THREADS): the cores the rest of the
machine leaves to this node's ranks, decided before the weights load and again every second while the engine
steps.

Why it follows the load: each parallel region of a step waits for its slowest thread. On cores other processes
keep busy, one of a rank's threads is preempted in most regions, and the others spin or sleep until it is back: on
a 2-core machine with one busy process per core, two threads ran the Q4_1 SmolLM2 benchmark at 0.33-0.56 of one
thread's speed (BENCHMARKS.md, "CPU threads on a busy machine"). So a rank takes

    threads = round((cores - the cores other processes used) / ranks on this node), at least 1, at most the ceiling

where the ceiling is the node's cores shared by its ranks, as before, and the cores come from sched_getaffinity.
"Other processes" is every CPU second /proc/stat counts (user, system, interrupts, steal) but niced time (a niced
process yields) and the engine's own: this process's and the server's HTTP process's, and as much again for
each other rank of the node (they run the same steps). A change needs two periods in a row to agree, and each
is logged. Without /proc/stat (not Linux) the ceiling holds.
"""
import logging
import os
import time
from dataclasses import dataclass

from nanovllm_tp import envs

log = logging.getLogger("nanovllm_tp")

PERIOD_S = 1.0          # how often a stepping engine looks again
FIRST_SAMPLE_S = 0.2    # the look before the weights load
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")     # /proc's unit of CPU time


def busy_jiffies(cpus: set[int]) -> int | None:
    """The CPU time /proc/stat counts on these cores as competing work (user, system, irq, softirq, steal; not
    nice, idle or iowait), in clock ticks; None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            v = [int(x) for x in rest.split()]
            total += v[0] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    return total


def _torch():
    """torch, imported on first use: serve's launcher imports this module before it sets GOMP_SPINCOUNT, which
    must come before torch loads libgomp."""
    import torch
    return torch


_ours: set[int] = set()          # other processes whose CPU time is the engine's own (the HTTP process)


def count_as_own(pid: int) -> None:
    """Process pid's CPU time is the engine's own, not competing load (serve's HTTP process)."""
    _ours.add(pid)


def own_seconds() -> float:
    """This process's CPU seconds, and those of the processes count_as_own named (while they live)."""
    t = os.times()
    total = t.user + t.system
    for pid in list(_ours):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) * TICK_S
        except (OSError, ValueError, IndexError):
            _ours.discard(pid)
    return total


@dataclass(slots=True)
class LoadMeter:
    """The cores other processes kept busy between two reads: /proc/stat's competing time on these cores, less
    this process's (with the processes count_as_own names) and, estimated as equal to it, that of the engine's
    `ranks - 1` other ranks of the node."""
    cpus: set
    ranks: int = 1
    at: float = 0.0
    busy: int = 0
    own: float = 0.0
    last: float = 0.0          # the last read's figure

    @classmethod
    def here(cls, ranks: int = 1) -> "LoadMeter | None":
        """A meter on this process's cores, its first sample taken; None without /proc/stat."""
        meter = cls(envs.usable_cpus(), ranks)
        return meter if meter.sample() else None

    def sample(self) -> bool:
        busy = busy_jiffies(self.cpus)
        if busy is None:
            return False
        self.at, self.busy, self.own = time.monotonic(), busy, own_seconds()
        return True

    def read(self) -> float:
        """Other processes' cores in use since the last read (or sample), and the sample becomes the last."""
        at, busy, own = self.at, self.busy, self.own
        if not self.sample():
            return self.last
        span = max(self.at - at, 1e-3)
        used = (self.busy - busy) * TICK_S / span
        self.last = max(0.0, used - (self.own - own) / span * self.ranks)
        return self.last


def others_busy(seconds: float = 0.1) -> float:
    """The cores processes other than this one keep busy, over a look of `seconds` (0.0 where /proc/stat cannot
    be read)."""
    meter = LoadMeter.here()
    if meter is None:
        return 0.0
    time.sleep(seconds)
    return meter.read()


@dataclass(slots=True)
class ThreadGovernor:
    """One process's torch thread count, following the other processes' load (see the module docstring)."""
    ceiling: int
    meter: LoadMeter
    pending: int = 0           # the count the last period wanted, where it differs from the current one
    changes: int = 0

    @property
    def foreign(self) -> float:
        """The cores other processes used over the last period."""
        return self.meter.last

    def wanted(self) -> int:
        """The count the period since the last reading asks for."""
        free = len(self.meter.cpus) - self.meter.read()
        return max(1, min(self.ceiling, int(free / self.meter.ranks + 0.5)))

    def start(self) -> None:
        """The first choice, before the weights load (the linear kernels are timed at this count): a short look."""
        time.sleep(FIRST_SAMPLE_S)
        self._set(self.wanted(), first=True)

    def tick(self) -> None:
        """Between steps: look again once a period has passed; change where two periods in a row agree."""
        if time.monotonic() - self.meter.at < PERIOD_S:
            return
        want = self.wanted()
        if want == _torch().get_num_threads():
            self.pending = 0
        elif want == self.pending:
            self._set(want)
        else:
            self.pending = want

    def _set(self, count: int, first: bool = False) -> None:
        before = _torch().get_num_threads()
        self.pending = 0
        if count == before and not first:
            return
        _torch().set_num_threads(count)
        if count != self.ceiling or not first:
            self.changes += not first
            log.info("CPU threads %s%d of %d: other processes use %.1f of %d cores", "" if first else
                     f"{before} -> ", count, self.ceiling, self.foreign, len(self.meter.cpus))


_governor: ThreadGovernor | None = None


def auto_ranks() -> int | None:
    """The node's engine ranks where a launcher chose this process's thread ceiling itself (OMP_NUM_THREADS set
    for it, serve), else None."""
    value = envs.get("NANOVLLM_TP_THREADS_AUTO")
    return int(value) if value and value.isdigit() and int(value) > 0 else None


def govern(ranks_on_node: int) -> ThreadGovernor | None:
    """This CPU process's threads: fixed where OMP_NUM_THREADS says so (and no launcher chose it), else a governor
    (one per process: the thread count is the process's) under the ceiling of cores per rank."""
    global _governor
    auto = auto_ranks()
    omp = envs.get("OMP_NUM_THREADS", "")
    if omp and auto is None:
        _governor = None                 # fixed: an earlier engine's governor of this process stops too
        return None
    ranks = auto or ranks_on_node
    ceiling = int(omp) if omp.isdigit() and int(omp) > 0 else envs.cores_per_rank(ranks)
    if _governor is not None and (_governor.ceiling, _governor.meter.ranks) == (ceiling, ranks):
        return _governor
    meter = LoadMeter.here(ranks)
    if meter is None:                    # no /proc/stat: the ceiling holds
        _governor = None
        _torch().set_num_threads(ceiling)
        return None
    _governor = ThreadGovernor(ceiling, meter)
    _governor.start()
    return _governor


def tick() -> None:
    """Called between steps on every rank: cheap unless a period has passed."""
    if _governor is not None:
        _governor.tick()


def report() -> dict:
    """LLM.stats()'s threads: the count now, and the governor's ceiling and last reading where one decides it."""
    g = _governor
    if g is None:
        return {"threads": _torch().get_num_threads(), "auto": False}
    return {"threads": _torch().get_num_threads(), "auto": True, "ceiling": g.ceiling,
            "other_cores": round(g.foreign, 2), "changes": g.changes}
