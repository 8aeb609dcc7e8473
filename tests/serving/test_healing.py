"""Scale-out that heals, against real servers on 127.0.0.1: a rank's death is seen while the engine is idle, not
at the next request; streams keep one finish per choice and end with [DONE] whatever happens; the router spreads
requests over free slots."""
import json
import os
import re
import signal
import time

import httpx
import pytest

from tests.procs import cmdline, descendants, wait_gone
from tests.serving.test_data_parallel import wait_all_ready
from tests.serving.test_serve import client, start_server, wait_ready

pytestmark = [pytest.mark.spawn, pytest.mark.slow]
SEEN_WITHIN = 3.0          # a rank's death shows in /health and /metrics within this (the issue asks 2 s; slack)


def titled(root: int, title: str) -> int | None:
    """The process below root whose title (what `ps` shows) starts with `title` (a whole word)."""
    for pid in descendants(root):
        if re.match(re.escape(title) + r"\b", cmdline(pid)):
            return pid
    return None


def is_zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def health(port: int) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)


def test_a_rank_of_an_idle_replica_killed_is_seen_within_seconds(tiny_model_dir):
    """-dp 2 --tp 2, nothing running: kill -9 of replica 1's rank 1. Its rank 0 sees the death by itself (the
    plan channel's watch), stops that replica (the dead rank reaped, no zombie), /health says degraded and
    replica_up{dp_rank="1"} 0 at once; the replica then comes back."""
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--tensor-parallel-size", "2")
    with ctx as proc:
        wait_all_ready(port, proc)
        victim = titled(proc.pid, "nanovllm_tp::dp1::tp1")
        assert victim is not None, [cmdline(p) for p in descendants(proc.pid)]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        seen = None
        while time.monotonic() - killed < 30:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            if 'replica_up{dp_rank="1",model_name="tiny"} 0.0' in text:
                seen = time.monotonic() - killed
                break
            time.sleep(0.1)
        assert seen is not None and seen < SEEN_WITHIN, f"the death was seen after {seen} s"
        body = health(port).json()
        assert body["status"] == "degraded" and "replica 1" in body["down"][0]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and titled(proc.pid, "nanovllm_tp::dp1::tp1") == victim:
            time.sleep(0.1)
        assert is_zombie_or_gone(victim) and titled(proc.pid, "nanovllm_tp::dp1::tp1") != victim
        wait_all_ready(port, proc)                      # the replica is back, both serve
        assert client(port, "none").completions.create(model="tiny", prompt="hi", max_tokens=4,
                                                       temperature=0).usage.completion_tokens == 4


def test_a_pipeline_stage_killed_while_idle_is_seen_and_the_server_stays_up(tiny_model_dir):
    """-pp 2, nothing running: kill -9 of stage 1. /health answers 503 naming the rank within seconds, requests
    get a clean 503, the server keeps answering (no traceback, no exit) until SIGTERM, which it obeys with 0."""
    log = f"/tmp/nvtp-test-pp-log-{os.getpid()}"
    with open(log, "w+") as err:
        port, ctx = start_server(tiny_model_dir, "--pipeline-parallel-size", "2", stderr=err)
        with ctx as proc:
            wait_ready(port, proc)
            victim = titled(proc.pid, "nanovllm_tp::tp1")
            assert victim is not None, [cmdline(p) for p in descendants(proc.pid)]
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            while time.monotonic() - killed < 30 and health(port).status_code == 200:
                time.sleep(0.1)
            seen = time.monotonic() - killed
            assert seen < SEEN_WITHIN, f"the death was seen after {seen:.1f} s"
            assert "rank 1" in health(port).json()["error"]["message"]
            assert is_zombie_or_gone(victim)
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 503, r.text
            time.sleep(2.5)                             # heartbeats of a stopped engine: no traceback, no exit
            assert proc.poll() is None
            pids = [proc.pid, *descendants(proc.pid)]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
            assert wait_gone(pids, 30) is not None
        err.seek(0)
        text = err.read()
    os.unlink(log)
    assert "Traceback" not in text, text[-3000:]
