"""`serve --data-parallel-size D` on one node, the process the command started: it runs no engine itself, but D
replica processes (`python -m nanovllm_tp.launch.serve ... --replica I,COMMANDS,OUTPUTS`: each its own LLM of
--tensor-parallel-size ranks and its own engine loop on sockets of its own) and the HTTP process, which routes
every request to one replica (replica_set.py). It watches them:

- a replica that dies is started again on the same sockets (--restart-dead-replicas) while the others serve, unless
  that was its RESTART_LIMIT-th failure within RESTART_WINDOW_S: a replica that keeps failing is left dead. A
  replica killed from outside (SIGKILL, SIGTERM, SIGINT, SIGHUP: an operator, the OOM killer; or one of its ranks
  so killed, exit code RANK_KILLED) did not fail: it is started again whatever the count, since nothing in it
  would fail the same way again. A crash (an error, SIGSEGV, SIGABRT, ...) counts;
- a replica that exits before it ever served (exit code NOT_STARTED: its engine could not be built, whatever the
  cause) stops the server with its reason: started again, it would most likely fail the same way, over and over;
- once every replica is left dead, the server stops too (`watch` says why), so that what supervises the command
  (systemd, Kubernetes) sees it fail and can start it anew, rather than an endpoint answering 503 for ever.

A rolling restart (SIGHUP to the command: serve_replicas.RollingRestart) restarts the serving replicas one at a
time: each gets SIGUSR1, hands its open requests to the others (they resume there) and exits 0, and is started
again; the next goes once it serves. The HTTP process's death, or SIGTERM, stops them all.
"""
import logging
import os
import signal
import subprocess
import sys
import time

from nanovllm_tp.distributed.channel_common import KILLED_BY
from nanovllm_tp.distributed.shm_ring import unlink_by_prefix

log = logging.getLogger("nanovllm_tp")
RESTART_LIMIT = 3             # a replica's deaths within RESTART_WINDOW_S after which it is left dead
RESTART_WINDOW_S = 60.0
NOT_STARTED = 3               # a replica's exit code when it failed before it served (launch/serve_replicas.py)
RANK_KILLED = 4               # ... when its engine stopped because one of its ranks was killed from outside
KILLED = (*KILLED_BY, RANK_KILLED)


class ReplicaProcesses:
    clock = staticmethod(time.monotonic)      # when a replica's death is counted (the tests give a fake one)

    def __init__(self, argv: list[str], endpoints: list[tuple[str, str]], threads: int | None, restart: bool,
                 rundir: str):
        """`argv`: the serve command's own arguments (each replica takes the engine's and ignores the server's);
        `threads`: each replica rank's CPU threads (None: as the environment says); `rundir`: the server's private
        directory, where a replica that cannot start writes why (`report_path`)."""
        self.argv, self.endpoints, self.threads, self.restart = argv, endpoints, threads, restart
        self.rundir = rundir
        self.procs: list[subprocess.Popen | None] = [None] * len(endpoints)
        self.deaths: list[list[float]] = [[] for _ in endpoints]
        self.given_up: dict[int, str] = {}    # replica -> why it was left dead
        self._restarting: set[int] = set()    # pids told to restart (SIGUSR1): on their way out

    def report_path(self, i: int) -> str:
        return os.path.join(self.rundir, f"replica-{i}.failed")

    def ready_path(self, i: int) -> str:
        """Where replica i writes its pid once it serves (the rolling restart waits for it)."""
        return os.path.join(self.rundir, f"replica-{i}.ready")

    def serving(self, i: int) -> bool:
        """Whether replica i's current process has said it serves."""
        proc = self.procs[i]
        try:
            with open(self.ready_path(i)) as f:
                return proc is not None and proc.poll() is None and f.read().strip() == str(proc.pid)
        except OSError:
            return False

    def restart_one(self, i: int) -> bool:
        """A planned restart of a serving replica (SIGUSR1: it moves its requests to the others and exits 0; watch
        starts it again). False if it is not running."""
        proc = self.procs[i]
        if i in self.given_up or proc is None or proc.poll() is not None:
            return False
        proc.send_signal(signal.SIGUSR1)
        self._restarting.add(proc.pid)
        return True

    def command(self, i: int) -> list[str]:
        commands, outputs = self.endpoints[i]
        cmd = [sys.executable, "-m", "nanovllm_tp.launch.serve", *self.argv, "--replica", f"{i},{commands},{outputs}",
               "--replica-report", self.report_path(i), "--replica-ready", self.ready_path(i)]
        if self.threads is not None:
            cmd += ["--threads", str(self.threads)]
        return cmd

    def start(self, i: int) -> None:
        env = {k: v for k, v in os.environ.items() if k != "NANOVLLM_TP_API_KEY"}
        self.procs[i] = subprocess.Popen(self.command(i), env=env)

    def start_all(self) -> None:
        for i in range(len(self.endpoints)):
            self.start(i)

    def watch(self) -> str | None:
        """Restart the replicas that died (within the limit). Returns why the server must stop (a replica could
        not start, or every one is left dead), else None."""
        now = self.clock()
        for i, proc in enumerate(self.procs):
            if i in self.given_up or proc is None or proc.poll() is None:
                continue
            unlink_by_prefix(f"nvtp_{proc.pid}_")       # what a killed replica could not remove itself
            if proc.returncode == NOT_STARTED:
                return f"replica {i} could not start: {self._reason(i)}"
            if proc.returncode == 0:          # a planned restart (restart_one): not a death
                log.info("replica %d stopped to restart: starting it again", i)
                self.start(i)
                continue
            if self.restart and proc.returncode in KILLED:
                log.warning("replica %d was killed (exit code %s): starting it again", i, proc.returncode)
                self.start(i)
                continue
            deaths = self.deaths[i] = [t for t in self.deaths[i] if now - t < RESTART_WINDOW_S] + [now]
            if not self.restart or len(deaths) >= RESTART_LIMIT:
                self.given_up[i] = (f"exited with {proc.returncode} (--no-restart-dead-replicas)" if not self.restart
                                    else f"died {len(deaths)} times within {RESTART_WINDOW_S:.0f} s (last exit "
                                         f"code {proc.returncode})")
                log.error("replica %d %s: left dead", i, self.given_up[i])
                continue
            log.warning("replica %d exited with %s: starting it again", i, proc.returncode)
            self.start(i)
        if len(self.given_up) == len(self.procs):
            return "no replica could be kept running: " + "; ".join(
                f"replica {i} {why}" for i, why in sorted(self.given_up.items()))
        return None

    def _reason(self, i: int) -> str:
        try:
            with open(self.report_path(i)) as f:
                return f.read().strip() or "no reason given"
        except OSError:
            return f"exit code {NOT_STARTED}, no reason written (its log above says more)"

    def stop(self, timeout: float) -> dict[int, int]:
        """SIGTERM to every live replica (each stops between two steps, and cuts a step that does not end within
        its --shutdown-timeout short itself), then SIGKILL to what is left after `timeout`. Returns the replicas
        that did not stop cleanly, with their exit codes (-9: killed here); a replica still loading, which a SIGTERM
        ends with -15 or 143 before it has anything to stop, stopped cleanly, as did one on its way out of a rolling
        restart (its requests moved already); one that ends because a rank of its was killed from outside
        (RANK_KILLED, which watch() would start again) is no failure of the stop either."""
        live = {i: p for i, p in enumerate(self.procs) if p is not None and p.poll() is None}
        # a SIGTERM while it loads, or while it leaves for a restart, ends it as it may
        loading = {i for i in live if not self.serving(i) or live[i].pid in self._restarting}
        for p in live.values():
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in live.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            unlink_by_prefix(f"nvtp_{p.pid}_")
        return {i: p.returncode for i, p in live.items()
                if p.returncode not in (0, RANK_KILLED)
                and not (i in loading and p.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM))}

    def kill(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
            if p is not None:
                unlink_by_prefix(f"nvtp_{p.pid}_")
