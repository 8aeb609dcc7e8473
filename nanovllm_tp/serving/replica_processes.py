"""`serve --data-parallel-size D` on one node, the process the command started: it runs no engine itself, but D
replica processes (`python -m nanovllm_tp.launch.serve ... --replica I,COMMANDS,OUTPUTS`: each its own LLM of
--tensor-parallel-size ranks and its own engine loop on sockets of its own) and the HTTP process, which routes
every request to one replica (replica_set.py). It watches them: a replica that dies is started again on the same
sockets (--restart-dead-replicas) while the others serve, unless it died RESTART_LIMIT times within
RESTART_WINDOW_S (a replica that cannot start stays dead; when every replica is so, the server exits); the HTTP
process's death, or SIGTERM, stops them all.
"""
import logging
import os
import signal
import subprocess
import sys
import time

from nanovllm_tp.distributed.shm_ring import unlink_by_prefix

log = logging.getLogger("nanovllm_tp")
RESTART_LIMIT = 3
RESTART_WINDOW_S = 60.0


class ReplicaProcesses:
    def __init__(self, argv: list[str], endpoints: list[tuple[str, str]], threads: int | None, restart: bool):
        """`argv`: the serve command's own arguments (each replica takes the engine's and ignores the server's);
        `threads`: each replica rank's CPU threads (None: as the environment says)."""
        self.argv, self.endpoints, self.threads, self.restart = argv, endpoints, threads, restart
        self.procs: list[subprocess.Popen | None] = [None] * len(endpoints)
        self.deaths: list[list[float]] = [[] for _ in endpoints]
        self.given_up: set[int] = set()

    def start(self, i: int) -> None:
        commands, outputs = self.endpoints[i]
        cmd = [sys.executable, "-m", "nanovllm_tp.launch.serve", *self.argv, "--replica", f"{i},{commands},{outputs}"]
        if self.threads is not None:
            cmd += ["--threads", str(self.threads)]
        env = {k: v for k, v in os.environ.items() if k != "NANOVLLM_TP_API_KEY"}
        self.procs[i] = subprocess.Popen(cmd, env=env)

    def start_all(self) -> None:
        for i in range(len(self.endpoints)):
            self.start(i)

    def watch(self) -> bool:
        """Restart the replicas that died (within the limit); False once none is alive or coming back."""
        now = time.monotonic()
        for i, proc in enumerate(self.procs):
            if i in self.given_up or proc is None or proc.poll() is None:
                continue
            unlink_by_prefix(f"nvtp_{proc.pid}_")       # what a killed replica could not remove itself
            deaths = self.deaths[i] = [t for t in self.deaths[i] if now - t < RESTART_WINDOW_S] + [now]
            if not self.restart or len(deaths) > RESTART_LIMIT:
                log.error("replica %d exited with %s; %s", i, proc.returncode,
                          "not restarted (--no-restart-dead-replicas)" if not self.restart else
                          f"it died {len(deaths)} times within {RESTART_WINDOW_S:.0f} s: left dead")
                self.given_up.add(i)
                continue
            log.warning("replica %d exited with %s: starting it again", i, proc.returncode)
            self.start(i)
        return len(self.given_up) < len(self.procs)

    def stop(self, timeout: float) -> None:
        """SIGTERM to every replica (each stops between two steps), then SIGKILL to what is left after timeout."""
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in live:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
            if p is not None:
                unlink_by_prefix(f"nvtp_{p.pid}_")
