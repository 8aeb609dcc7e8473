"""Process helpers for tests that start engines: every tree they start is killed, whatever happens."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

from nanovllm_tp.distributed.channel_common import proc_start_time
from nanovllm_tp.launch import serve_process

free_port = serve_process.free_port     # the same helper as the serving benchmark's

SHM_DIR = "/dev/shm"


def our_shm_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("nvtp_")} if os.path.isdir(SHM_DIR) else set()


def segments_of(pid: int) -> set[str]:
    """Segments created by the engine whose rank 0 had this pid (names carry the writer's pid)."""
    return {s for s in our_shm_segments() if s.startswith(f"nvtp_{pid}_")}




# How long a test waits for processes that should end now (after a signal, a dead peer, a closed engine):
# generous for a loaded 2-core machine, and still far below gloo's 120 s timeout, which a hang would wait for.
GONE_WITHIN = 45.0


def wait_gone(pids, timeout: float = GONE_WITHIN) -> float | None:
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


def alive(pid: int) -> bool:
    """A live process, not a zombie."""
    return proc_start_time(pid) is not None


def descendants(root: int) -> list[int]:
    """Every live process below root (torchrun starts its workers in sessions of their own)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if alive(child):
                found.append(child)
                todo.append(child)
    return found


@contextlib.contextmanager
def started(cmd: list[str], env: dict | None = None, **kwargs):
    """Popen in its own session; on exit the whole session and everything below it is killed and reaped."""
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, start_new_session=True, **kwargs)
    try:
        yield proc
    finally:
        for pid in {*descendants(proc.pid), *session_pids(proc.pid)}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(timeout=10)


def python_cmd(*args) -> list[str]:
    return [sys.executable, *args]


def cmdline(pid: int) -> str:
    """What /proc shows as the process's command line ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


# The server's processes as /proc shows them: their title (utils/proctitle.py, with setproctitle installed), or
# their command without it.
_ROLES = {"http": re.compile(r"^nanovllm_tp::http\b|nanovllm_tp\.serving\.frontend"),
          "worker": re.compile(r"^nanovllm_tp::(?:dp\d+::)?tp[1-9]\d*\b|nanovllm_tp\.workers\.worker")}


def processes_of(root: int, role: str) -> list[int]:
    """The processes below root that play `role`: "http" (the HTTP process) or "worker" (a rank > 0 it spawned)."""
    return [pid for pid in descendants(root) if _ROLES[role].search(cmdline(pid))]


# torchrun as torchrun.sh runs it (the same flags; its log directory removed on exit, which plain torchrun leaves)
TORCHRUN = ("-m", "nanovllm_tp.launch.torchrun")


# Printed by Python's resource_tracker when a process dies with shared memory it still had registered: the
# engine removes its own segments, so this must never appear in a rank's output.
LEAK_WARNING = "leaked shared_memory objects"


def rank_pid(root: int, rank: int, marker: str) -> int | None:
    """The process below root whose command line contains `marker` and whose environment says RANK=rank
    (a torchrun worker; its agent has no RANK, a resource tracker runs another command)."""
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if marker in cmdline and f"RANK={rank}".encode() in environ:
            return pid
    return None


# What the engine, the server and torchrun.sh leave in /tmp and /dev/shm while they run, each name carrying the pid
# of the process that made it and removes it; and what they must never leave at all.
_OWNED = (("/tmp", re.compile(r"nanovllm_tp-(?:serve|torchrun)-(\d+)-")), ("/tmp", re.compile(r"nvtp_store_(\d+)_")),
          (SHM_DIR, re.compile(r"nvtp_(\d+)_")))
_NEVER = (("/tmp", "torchelastic_"),)
_UNOWNED = (("/tmp", "nvtp_store_"), ("/tmp", "nvtp_secret_"))     # removed by the engine that made them, at close


def _listing(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


def run_files() -> set[str]:
    """Every path of the kinds above that exists now."""
    found = set()
    for directory, pattern in _OWNED:
        found |= {os.path.join(directory, n) for n in _listing(directory) if pattern.match(n)}
    for directory, prefix in _NEVER + _UNOWNED:
        found |= {os.path.join(directory, n) for n in _listing(directory) if n.startswith(prefix)}
    return found


def left_behind(before: set[str], unowned: bool = False, grace: float = 15.0) -> list[str]:
    """Paths made since `before` that outlive their maker (or that nothing should make), after a grace period for
    the cleanups that run asynchronously (a rank that finds its writer dead unlinks the writer's segments).
    `unowned`: also count the engine's pid-less directories (only meaningful once every engine is closed)."""
    def leaks() -> list[str]:
        out = []
        for path in run_files() - before:
            name = os.path.basename(path)
            owner = next((m for d, p in _OWNED if path.startswith(d + "/") and (m := p.match(name))), None)
            if owner is not None:
                if not alive(int(owner.group(1))):
                    out.append(path)
            elif unowned or any(name.startswith(prefix) for _, prefix in _NEVER):
                out.append(path)
        return sorted(out)
    deadline = time.monotonic() + grace
    found = leaks()
    while found and time.monotonic() < deadline:
        time.sleep(0.2)
        found = leaks()
    return found


@contextlib.contextmanager
def busy_machine(spinners: int = 2):
    """Processes that keep `spinners` cores of the test machine busy while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
