"""Our OpenAI server (launch/serve) as a child process, for the serving benchmark and the tests: started on a
free 127.0.0.1 port with the engine flags of a parsed command line, ready once /health answers, stopped with
SIGTERM (killed if it does not exit in time)."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

READY_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], api_key: str | None = None) -> tuple[subprocess.Popen, str]:
    """The server process and its OpenAI base URL, once /health answers 200. SystemExit if it exits first or is
    not ready within READY_TIMEOUT_S (then it is stopped)."""
    import httpx
    port = free_port()
    cmd = [sys.executable, "-m", "nanovllm_tp.launch.serve", "--port", str(port), *argv]
    if api_key:
        cmd += ["--api-key", api_key]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, f"http://127.0.0.1:{port}/v1"
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop(proc)
    raise SystemExit(f"the server was not ready within {READY_TIMEOUT_S:.0f} s")


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
