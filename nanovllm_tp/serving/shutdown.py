"""SIGTERM / SIGINT on the server's rank 0: the engine loop stops between two steps; a step that does not end in
time (a stuck rank, a kernel that never returns) is not waited for.

Python runs a signal handler in the main thread, between two bytecodes: never while that thread is inside a long
C call. So the signal also wakes a watcher thread (through `signal.set_wakeup_fd`, written by the C-level
handler), which gives the main thread `timeout` seconds to finish its cleanup, and otherwise kills what is left
(the HTTP process, spawned ranks), removes what they shared and exits with 128 + SIGTERM.
"""
import logging
import os
import shutil
import signal
import socket
import threading

log = logging.getLogger("nanovllm_tp")


class StopSignals:
    def __init__(self, timeout: float, emergency):
        """Installs the handlers (main thread only). `emergency()`: what the watcher does before it exits the
        process, when the main thread has not set `done` within `timeout` seconds of the first signal."""
        self.received: list[int] = []
        self.done = threading.Event()
        self._cutting = threading.Event()       # the watcher gave up on the main thread: 143 is on its way
        self._timeout, self._emergency = timeout, emergency
        self._wake, wake_w = socket.socketpair()
        wake_w.setblocking(False)
        self._wake_w = wake_w                   # kept open for the process's life
        signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._watcher = threading.Thread(target=self._watch, name="stop-watch", daemon=True)
        self._watcher.start()

    def _on_signal(self, signum, frame) -> None:
        self.received.append(signum)

    def finished(self) -> None:
        """The main thread's cleanup is over. Where the watcher already gave up on it (killing the ranks is what
        freed the main thread), the watcher's exit with 143 is on its way: wait for it instead of exiting 0."""
        self.done.set()
        if self._cutting.is_set():
            self._watcher.join(60)

    def _watch(self) -> None:
        while True:                 # every signal with a Python handler writes its number here: wait for ours
            try:
                signum = self._wake.recv(1)
            except OSError:
                return
            if not signum or signum[0] in (signal.SIGTERM, signal.SIGINT):
                break
        if self.done.wait(self._timeout):
            return
        self._cutting.set()
        log.error("shutdown: the engine did not stop within %.0f s of the signal (--shutdown-timeout); every "
                  "rank is killed", self._timeout)
        try:
            self._emergency()
        finally:
            os._exit(128 + signal.SIGTERM)


def hard_stop(front, llm, rundir: str | None) -> None:
    """Rank 0 cannot finish its step: stop the HTTP process, kill the ranks rank 0 spawned, remove the engine's
    shared memory (named after this pid), the spawn store and the sockets' directory. Ranks started by torchrun
    see rank 0 gone and leave on their own."""
    from nanovllm_tp.distributed.launch import stop_children
    from nanovllm_tp.distributed.shm_ring import unlink_by_prefix
    engine = getattr(llm, "engine", None)
    for proc in getattr(engine, "children", []):
        if proc.poll() is None:
            proc.kill()
    if front is not None:
        stop_children([front], timeout=0)     # SIGTERM: its open requests end with an error; then SIGKILL
    unlink_by_prefix(f"nvtp_{os.getpid()}_")
    rendezvous = getattr(engine, "_rendezvous", None)
    if rendezvous is not None:
        rendezvous.close()
    if rundir is not None:          # a data-parallel replica's sockets are in its server's directory
        shutil.rmtree(rundir, ignore_errors=True)
