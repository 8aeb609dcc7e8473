"""Process helpers for tests that start engines: every tree they start is killed, whatever happens."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

SHM_DIR = "/dev/shm"


def our_shm_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("nvtp_")} if os.path.isdir(SHM_DIR) else set()


def segments_of(pid: int) -> set[str]:
    """Segments created by the engine whose rank 0 had this pid (names carry the writer's pid)."""
    return {s for s in our_shm_segments() if s.startswith(f"nvtp_{pid}_")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait_gone(pids, timeout: float) -> float | None:
    """Seconds until every pid is gone, or None if some outlive the timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if not any(alive(p) for p in pids):
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def session_pids(sid: int) -> list[int]:
    """Every live process of a session (what a test started with start_new_session=True)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid and alive(int(entry)):
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


@contextlib.contextmanager
def started(cmd: list[str], env: dict | None = None, **kwargs):
    """Popen in its own session; on exit the whole session is killed and reaped."""
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, start_new_session=True, **kwargs)
    try:
        yield proc
    finally:
        for pid in session_pids(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(timeout=10)


def python_cmd(*args) -> list[str]:
    return [sys.executable, *args]
