"""`serve --data-parallel-size 2`: two engine replicas behind one endpoint, as clients meet them through the
`openai` client: the answers of one engine, requests spread by the router, and a replica killed with kill -9
failing only its own requests, the others served meanwhile, and the replica back within seconds."""
import json
import os
import re
import signal
import time

import httpx
import pytest

from tests.procs import wait_gone
from tests.serving.test_serve import PROMPTS, _children, _cmdline, client, offline, start_server, wait_ready

pytestmark = [pytest.mark.spawn, pytest.mark.slow]
BACK_WITHIN = 60.0         # a restarted replica loads the tiny model again: seconds on a loaded 2-core machine


def replicas(pid: int) -> dict[int, int]:
    """The server's replica processes: dp rank -> pid."""
    out = {}
    for child in _children(pid):
        found = re.search(r"--replica\x00(\d+),", _cmdline(child))
        if found:
            out[int(found.group(1))] = child
    return out


def wait_all_ready(port: int, proc) -> None:
    """Until every replica serves: /health says 200 with no body (a body says some are down or starting)."""
    wait_ready(port, proc)
    deadline = time.monotonic() + BACK_WITHIN
    while time.monotonic() < deadline:
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        if health.status_code == 200 and not health.content:
            return
        time.sleep(0.2)
    pytest.fail(f"the replicas did not all come up: {health.text}")


def routed(port: int) -> dict[int, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {int(rank): float(v) for rank, v in
            re.findall(r'nanovllm_tp:router_requests_routed_total\{dp_rank="(\d+)",model_name="tiny",policy="[^"]+"\} '
                       r'(\S+)', text)}


def test_two_replicas_answer_as_one_engine(tiny_model_dir, tiny_llm):
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--router", "round-robin")
    with ctx as proc:
        wait_all_ready(port, proc)
        assert sorted(replicas(proc.pid)) == [0, 1]
        c = client(port)
        want = [o.outputs[0].text for o in offline(tiny_llm, PROMPTS)]
        got = [c.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text
               for p in PROMPTS]
        assert got == want
        streamed = ["".join(ch.choices[0].text for ch in c.completions.create(
            model="tiny", prompt=p, max_tokens=16, temperature=0, stream=True)) for p in PROMPTS]
        assert streamed == want
        both = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0, n=2)
        assert [ch.text for ch in both.choices] == [want[0]] * 2
        stops = [o.outputs[0].text for o in offline(tiny_llm, PROMPTS, stop=[" the"])]
        assert [c.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0, stop=[" the"])
                .choices[0].text for p in PROMPTS] == stops
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                  "additionalProperties": False}
        for _ in range(2):                              # one on each replica
            out = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=200, temperature=0,
                                       extra_body={"structured_outputs": {"json": schema}})
            assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(out.choices[0].text)["n"], int)
        counts = routed(port)
        assert counts[0] >= 6 and counts[1] >= 6, counts       # round-robin: every other request
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text     # each replica's own figures
        for rank in (0, 1):
            queried = re.search(rf'nanovllm_tp:prefix_cache_queries_total{{dp_rank="{rank}",model_name="tiny"}} '
                                r'(\S+)', text)
            assert queried and float(queried.group(1)) > 0, text
            assert f'nanovllm_tp:num_requests_running{{dp_rank="{rank}",model_name="tiny"}} 0.0' in text
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200


def test_a_killed_replica_fails_only_its_requests_and_comes_back(tiny_model_dir, tiny_llm):
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--router", "round-robin")
    with ctx as proc:
        wait_all_ready(port, proc)
        c = client(port)
        first = replicas(proc.pid)
        want = offline(tiny_llm, PROMPTS[:1])[0].outputs[0].text
        stream = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=400, stream=True,
                                      temperature=0, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)                                    # it runs: on replica 0, round-robin's first
        os.kill(first[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(Exception):                  # the stream ends with the replica's error, no hang
            for _ in chunks:
                pass
        assert time.monotonic() - start < 10
        for _ in range(3):                              # meanwhile the other replica serves every request
            out = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0)
            assert out.choices[0].text == want
        assert time.monotonic() - start < 20
        deadline = time.monotonic() + BACK_WITHIN
        while time.monotonic() < deadline:              # started again, and serving once it says ready
            back = replicas(proc.pid).get(0)
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
            if back not in (None, first[0]) and health.status_code == 200 and not health.content:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"replica 0 did not come back within {BACK_WITHIN:.0f} s: {health.text}")
        before = routed(port)
        for _ in range(4):
            assert c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16,
                                        temperature=0).choices[0].text == want
        after = routed(port)
        assert after[0] > before[0] and after[1] > before[1]
        pids = [proc.pid, *_children(proc.pid)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert wait_gone(pids, 30) is not None


def test_the_health_of_a_server_with_a_dead_replica_says_degraded(tiny_model_dir):
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--no-restart-dead-replicas")
    with ctx as proc:
        wait_all_ready(port, proc)
        os.kill(replicas(proc.pid)[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
            if health.content:
                break
            time.sleep(0.2)
        body = health.json()
        assert health.status_code == 200 and body["status"] == "degraded" and body["replicas_alive"] == 1
        assert "replica 1" in body["down"][0]
        assert client(port).completions.create(model="tiny", prompt="hi", max_tokens=4).usage.completion_tokens == 4
