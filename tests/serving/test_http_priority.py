"""The HTTP process at idle priority on cores other processes keep busy (serving/http_priority.py): a real server
with the default threads (ranks of several threads: the HTTP process at SCHED_IDLE), then two spinning
processes beside it. At SCHED_IDLE alone it would never run again and no request would be answered."""
import os
import time

import httpx
import pytest

from tests.procs import busy_machine
from tests.serving.test_serve import start_server, wait_ready

CPUS = len(os.sched_getaffinity(0))
pytestmark = [pytest.mark.spawn, pytest.mark.slow,
              pytest.mark.skipif(CPUS < 2 or not hasattr(os, "SCHED_IDLE"), reason="needs 2 cores and SCHED_IDLE")]


def completion(port: int, timeout: float) -> str:
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def wait_for_line(log, text: str, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if text in log.read_text():
            return True
        time.sleep(0.5)
    return False


def test_a_server_beside_busy_processes_answers_and_its_http_process_returns_to_idle(tiny_model_dir, tmp_path,
                                                                                        busy_cores, monkeypatch):
    if busy_cores:
        pytest.skip("--busy-cores: this test starts and stops its own busy processes")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)      # serve's default: a thread per core, HTTP at idle
    log = tmp_path / "serve.log"
    port, ctx = start_server(tiny_model_dir, "--disable-log-requests", "--disable-uvicorn-access-log",
                             stderr=open(log, "w"))
    with ctx as proc:
        wait_ready(port, proc)
        quiet_answer = completion(port, 60)
        assert "normal priority" not in log.read_text()          # quiet: the engine's own work is not load
        with busy_machine(CPUS):
            assert wait_for_line(log, "HTTP process at normal priority", 30), log.read_text()[-2000:]
            assert completion(port, 120) == quiet_answer
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        assert wait_for_line(log, "HTTP process back at idle priority", 30), log.read_text()[-2000:]
        assert completion(port, 60) == quiet_answer
