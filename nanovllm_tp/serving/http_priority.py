"""The idle-priority HTTP process kept alive on busy cores.

`serve` runs the HTTP process at SCHED_IDLE beside CPU ranks of several threads (launch/serve.py says why). A
SCHED_IDLE thread runs only on a core nothing else wants, so where other processes keep every core busy (a
build, another engine, two `while True: pass`) it never runs, and the server answers nothing, not even /health.
A watcher thread in the process that started it reads the other processes' load once a second
(config/cpu_threads.py's LoadMeter: the engine's ranks and the HTTP process itself not counted) and moves every
thread of the HTTP process to the normal policy once that load has reached half a core in two readings in a row;
back to SCHED_IDLE once it has stayed under a quarter of a core for five. On cores that busy the engine's ranks
have dropped to one thread each (config/cpu_threads.py), with no parallel region for the HTTP process to hold up:
the case where serve starts it at normal priority anyway (launch/engine_server.py http_at_idle)."""
import logging
import os
import threading
from dataclasses import dataclass, field

from nanovllm_tp.config.cpu_threads import LoadMeter

log = logging.getLogger("nanovllm_tp")

BUSY_CORES, QUIET_CORES = 0.5, 0.25
BUSY_READINGS, QUIET_READINGS = 2, 5
PERIOD_S = 1.0


def set_policy(pid: int, idle: bool) -> bool:
    """Every thread of process pid to SCHED_IDLE (idle) or SCHED_OTHER; False where it cannot be done."""
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return False
    done = False
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            done = True
        except OSError:          # a thread that just ended; no permission
            pass
    return done


@dataclass(slots=True)
class HttpPriority:
    """The watcher of one HTTP process (see the module docstring); `idle` is its policy now."""
    pid: int
    meter: LoadMeter
    idle: bool = True
    streak: int = 0              # readings in a row that argue for the other policy
    moves: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def watch(cls, pid: int, ranks: int = 1) -> "HttpPriority | None":
        """Start watching (a daemon thread) from an engine process with `ranks` engine ranks on its node (a
        launcher that runs no engine: 1, and the engines' work counts as other processes' load); None where
        there is no SCHED_IDLE or no /proc/stat."""
        meter = LoadMeter.here(ranks)
        if meter is None or not hasattr(os, "SCHED_IDLE"):
            return None
        watcher = cls(pid, meter)
        threading.Thread(target=watcher._run, name="http-priority", daemon=True).start()
        return watcher

    def reading(self, load: float) -> None:
        """One reading of the other processes' cores in use: moves the HTTP process where the rule says."""
        move = load >= BUSY_CORES if self.idle else load < QUIET_CORES
        self.streak = self.streak + 1 if move else 0
        if self.streak >= (BUSY_READINGS if self.idle else QUIET_READINGS):
            if set_policy(self.pid, not self.idle):
                self.idle, self.moves = not self.idle, self.moves + 1
                log.info("HTTP process %s: other processes use %.1f cores", "back at idle priority (SCHED_IDLE)"
                         if self.idle else "at normal priority (at idle priority it would not run)", load)
            self.streak = 0

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            try:
                os.kill(self.pid, 0)
            except OSError:
                return
            self.reading(self.meter.read())

    def stop(self) -> None:
        self._stop.set()
