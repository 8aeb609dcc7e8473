"""SIGHUP to a data-parallel server (`serve -dp D` on one node): restart every replica, one at a time, with no
request failed (nginx's and gunicorn's convention for "reload").

The supervisor (launch/serve_replicas.py) asks `step()` at every look at its replicas. A replica is restarted only
while every other replica serves, so that D - 1 replicas always take the traffic: it gets SIGUSR1, tells the HTTP
process it is restarting (its open requests move to the others: those read in part resume there, the rest run
again; serving/replica_set.py), exits 0, and is started again (ReplicaProcesses.watch); once the new process
serves (its ready file names its pid) the next one goes. A replica that does not serve again within READY_S is
passed over with a warning. A SIGHUP during a rolling restart is logged and ignored.
"""
import logging
import time

log = logging.getLogger("nanovllm_tp")
READY_S = 300.0            # how long one replica may take to serve again before the restart goes on without it


class RollingRestart:
    def __init__(self, replicas):
        """`replicas`: the supervisor's ReplicaProcesses."""
        self.replicas = replicas
        self.requested = False             # set by the SIGHUP handler; taken by step()
        self.pending: list[int] = []       # replicas still to restart, in order
        self.current: tuple[int, int, float] | None = None     # (replica, its old pid, when it was told)

    def request(self) -> None:
        self.requested = True

    @property
    def active(self) -> bool:
        return bool(self.pending) or self.current is not None

    def step(self) -> None:
        replicas = self.replicas
        if self.requested:
            self.requested = False
            if self.active:
                log.warning("SIGHUP: a rolling restart is under way already; ignored")
            else:
                self.pending = [i for i in range(len(replicas.procs)) if i not in replicas.given_up]
                log.info("SIGHUP: restarting the %d replicas one at a time", len(self.pending))
        if self.current is not None:
            if not self._current_back():
                return
            self.current = None
            if not self.pending:
                self._finished()
                return
        while self.pending:
            i = self.pending[0]
            others = [j for j in range(len(replicas.procs)) if j != i and j not in replicas.given_up]
            if not all(replicas.serving(j) for j in others):
                return                     # the traffic needs them: wait until they serve
            self.pending.pop(0)
            old = replicas.procs[i].pid if replicas.procs[i] is not None else -1
            if replicas.restart_one(i):
                log.info("rolling restart: replica %d stops (its requests move to the others)", i)
                self.current = (i, old, time.monotonic())
                return
            if not self.pending:
                self._finished()

    def _finished(self) -> None:
        log.info("rolling restart: every replica restarted")

    def _current_back(self) -> bool:
        """Whether the replica being restarted serves again (or was left dead, or is overdue)."""
        i, old, at = self.current
        proc = self.replicas.procs[i]
        if proc is not None and proc.pid != old and self.replicas.serving(i):
            log.info("rolling restart: replica %d serves again", i)
        elif i in self.replicas.given_up:
            log.warning("rolling restart: replica %d is left dead", i)
        elif time.monotonic() - at > READY_S:
            log.warning("rolling restart: replica %d did not serve again within %.0f s; going on", i, READY_S)
        else:
            return False
        return True
