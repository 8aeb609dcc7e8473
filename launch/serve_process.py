"""Our OpenAI server (launch/serve) as a child process, for the serving benchmark and the tests: started on a
free 127.0.0.1 port with the engine flags of a parsed command line, ready once /health answers, stopped with
SIGTERM (killed if it does not exit in time)."""
from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request

READY_TIMEOUT_S = 300.0
# urllib without the environment's proxies: every server here listens on 127.0.0.1
open_local = urllib.request.build_opener(urllib.request.ProxyHandler({})).open


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], api_key: str | None = None) -> tuple[subprocess.Popen, str]:
    """The server process and its OpenAI base URL, once /health answers 200. SystemExit if it exits first or is
    not ready within READY_TIMEOUT_S (then it is stopped). A benchmark's server logs no line per request (the
    benchmark counts them itself) unless argv asks for it."""
    port = free_port()
    quiet = [] if any(a.startswith("--enable-log-requests") for a in argv) else [
        "--disable-log-requests", "--disable-uvicorn-access-log"]
    cmd = [sys.executable, "-m", "nanovllm_tp.launch.serve", "--port", str(port), *quiet, *argv]
    if api_key:
        cmd += ["--api-key", api_key]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}/health", "the server")
    except SystemExit:
        stop(proc)
        raise
    return proc, f"http://127.0.0.1:{port}/v1"


def tree(root: int) -> list[int]:
    """root and every process below it, now (the server's HTTP process, replicas and ranks)."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def title(pid: int) -> str:
    """A process's title as `ps` shows it (utils/proctitle.py; its command's first word without setproctitle), ""
    once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def _says_ready(body: bytes) -> bool:
    if not body.strip():
        return True
    try:
        return json.loads(body).get("status") == "ok"
    except (ValueError, AttributeError):
        return False


def wait_healthy(proc: subprocess.Popen, url: str, what: str, timeout: float = READY_TIMEOUT_S) -> None:
    """Until GET url answers ready: 200 with no body (ours), or with the JSON body {"status": "ok"} (llama.cpp's
    llama-server). A server still loading answers 503, or nothing; ours with data-parallel replicas still starting
    answers 200 with {"status": "degraded", ...}. SystemExit if the process exits first or the time runs out;
    stopping it is the caller's."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} before it was ready")
        try:
            with open_local(url, timeout=1) as resp:
                if resp.status == 200 and _says_ready(resp.read()):
                    return
        except (OSError, http.client.HTTPException):       # refused, 503 (HTTPError), a reset, a timeout
            pass
        time.sleep(0.2)
    raise SystemExit(f"{what} was not ready within {timeout:.0f} s")


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
