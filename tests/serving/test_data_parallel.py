"""`serve --data-parallel-size 2`: two engine replicas behind one endpoint, as clients meet them through the
`openai` client: the answers of one engine, requests spread by the router, and a replica killed with kill -9
failing only its own requests, the others served meanwhile, and the replica back within seconds."""
import json
import os
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.procs import TORCHRUN, cmdline, descendants, free_port, python_cmd, started, wait_gone
from tests.serving.test_lora_serve import adapters, complete  # noqa: F401  (adapters: a module fixture)
from tests.serving.test_serve import (ENGINE_ARGS, PROMPTS, _children, client, metrics, offline,
                                      start_server, wait_ready)

pytestmark = [pytest.mark.spawn, pytest.mark.slow]
BACK_WITHIN = 60.0         # a restarted replica loads the tiny model again: seconds on a loaded 2-core machine


def replicas(pid: int) -> dict[int, int]:
    """The server's replica processes, by the title each gives itself (what `ps` shows): dp rank -> pid."""
    out = {}
    for child in _children(pid):
        found = re.match(r"nanovllm_tp::dp(\d+)::tp0\b", cmdline(child))
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


def wait_replica_back(port: int, proc, index: int, old_pid: int) -> None:
    """Until replica `index` runs in a new process and every replica serves (/health 200 with no body); the
    server must not stop meanwhile."""
    deadline = time.monotonic() + BACK_WITHIN
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server stopped: replica {index} did not come back"
        back = replicas(proc.pid).get(index)
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        if back not in (None, old_pid) and health.status_code == 200 and not health.content:
            return
        time.sleep(0.5)
    pytest.fail(f"replica {index} did not come back within {BACK_WITHIN:.0f} s: {health.text}")


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


def test_a_killed_replicas_stream_goes_on_elsewhere_and_the_replica_comes_back(tiny_model_dir, tiny_llm):
    """The stream is long (3000 tokens) so that the kill lands before it is done even on a loaded machine; it is
    resumed on the other replica (no error, all its tokens), which serves every other request meanwhile."""
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--router", "round-robin",
                             "--max-model-len", "4096")
    with ctx as proc:
        wait_all_ready(port, proc)
        c = client(port)
        first = replicas(proc.pid)
        want = offline(tiny_llm, PROMPTS[:1])[0].outputs[0].text
        stream = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=3000, stream=True,
                                      temperature=0, extra_body={"ignore_eos": True},
                                      stream_options={"include_usage": True})
        chunks = iter(stream)
        next(chunks)                                    # it runs: on replica 0, round-robin's first
        os.kill(first[0], signal.SIGKILL)
        start = time.monotonic()
        ends = []
        reader = threading.Thread(target=lambda: ends.extend(chunk for chunk in chunks))
        reader.start()
        for _ in range(3):                              # meanwhile the other replica serves every request
            out = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0)
            assert out.choices[0].text == want
        assert time.monotonic() - start < 20
        reader.join(300)
        assert ends[-1].usage.completion_tokens == 3000
        assert [ch.choices[0].finish_reason for ch in ends if ch.choices][-1] == "length"
        wait_replica_back(port, proc, 0, first[0])     # started again, and serving once it says ready
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


def test_a_non_streamed_request_goes_on_on_another_replica(tiny_model_dir, tiny_llm):
    """A non-streamed request's answer is read only once whole: its replica killed mid-generation, it goes on on
    the other replica from the tokens its replica had sent (from its start if none yet) and the client gets the
    full, right answer. The answer is long (3000 tokens, seconds on this model) so that the kill lands before it
    is done even on a loaded machine."""
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--router", "round-robin",
                             "--no-restart-dead-replicas", "--max-model-len", "4096")
    with ctx as proc:
        wait_all_ready(port, proc)
        c = client(port)
        want = offline(tiny_llm, PROMPTS[1:2], max_tokens=3000, ignore_eos=True)[0].outputs[0].text
        result = {}

        def ask():
            result["out"] = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=3000, temperature=0,
                                                 extra_body={"ignore_eos": True})
        asking = threading.Thread(target=ask)
        asking.start()                                  # round-robin's first request: replica 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and 'num_requests_running{dp_rank="0",model_name="tiny"} 1.0' not in \
                httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text:
            time.sleep(0.05)
        os.kill(replicas(proc.pid)[0], signal.SIGKILL)
        asking.join(120)
        out = result["out"].choices[0]
        assert out.text == want and out.finish_reason == "length"
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        moved = [float(re.search(rf'nanovllm_tp:router_requests_{how}_total\{{model_name="tiny"\}} (\S+)',
                                 text).group(1)) for how in ("resumed", "resubmitted")]
        assert sum(moved) == 1, text


def test_replicas_of_two_ranks_each_and_their_process_titles(tiny_model_dir, tiny_llm):
    """D=2 x T=2: four engine ranks; every process says in `ps` what it is."""
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                             "--router", "round-robin")
    with ctx as proc:
        wait_all_ready(port, proc)
        want = [o.outputs[0].text for o in offline(tiny_llm, PROMPTS)]
        c = client(port)
        assert [c.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text
                for p in PROMPTS * 2] == want * 2
        titles = sorted(cmdline(pid).split("\x00")[0].strip() for pid in [proc.pid, *descendants(proc.pid)]
                        if "resource_tracker" not in cmdline(pid))     # Python's shared-memory helper
        assert titles == ["nanovllm_tp::dp0::tp0", "nanovllm_tp::dp0::tp1", "nanovllm_tp::dp1::tp0",
                          "nanovllm_tp::dp1::tp1", "nanovllm_tp::http", "nanovllm_tp::serve"], titles
        with open(f"/proc/{replicas(proc.pid)[1]}/comm") as f:          # the short name top and ps -e show
            assert f.read().strip() == "nvtp-dp1-tp0"
        pids = [proc.pid, *descendants(proc.pid)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert wait_gone(pids, 30) is not None


def test_adapters_through_the_router(tiny_model_dir, adapters):
    """--lora-modules on every replica, a runtime load reaching both, each adapter's text equal to transformers +
    peft on either replica."""
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--router", "round-robin",
                             "--enable-lora", "--max-loras", "2", "--lora-modules", f"a1={adapters['a1'][0]}",
                             "--allow-runtime-lora-updating")
    with ctx as proc:
        wait_all_ready(port, proc)
        loaded = httpx.post(f"http://127.0.0.1:{port}/v1/load_lora_adapter",
                            json={"lora_name": "a3", "lora_path": adapters["a3"][0]}, timeout=60)
        assert loaded.status_code == 200, loaded.text
        c = client(port)
        for name in ("a1", "a1", "tiny", "tiny", "a3", "a3"):        # round-robin: each one on both replicas
            assert complete(c, name).choices[0].text == adapters[name][1], name
        counts = routed(port)
        assert counts[0] == counts[1] == 3, counts


def test_torchrun_as_two_nodes_one_replica_each(tiny_model_dir, tiny_llm, tmp_path):
    """`serve -dp 2` launched by torchrun as two nodes on 127.0.0.1: node 1's replica registers with node 0's HTTP
    process over CURVE, answers as one engine does, and stops when node 0 is stopped."""
    port, master = free_port(), free_port()
    secret = {"NANOVLLM_TP_SECRET": "two-node-replicas-secret-0123456789abcdef"}      # multi-node needs one
    nodes = [python_cmd(*TORCHRUN, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                        "--master-addr", "127.0.0.1", "--master-port", str(master),
                        "-m", "nanovllm_tp.launch.serve", "--model", tiny_model_dir, "--port", str(port),
                        "--served-model-name", "tiny", *ENGINE_ARGS, "--data-parallel-size", "2",
                        "--router", "round-robin") for n in (0, 1)]
    logs = [open(tmp_path / f"node{n}.log", "w+") for n in (0, 1)]
    with started(nodes[1], env=secret, stdout=logs[1], stderr=subprocess.STDOUT) as node1, \
            started(nodes[0], env=secret, stdout=logs[0], stderr=subprocess.STDOUT) as node0:
        wait_all_ready(port, node0)
        c = client(port)
        want = [o.outputs[0].text for o in offline(tiny_llm, PROMPTS)]
        assert [c.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text
                for p in PROMPTS] == want
        streamed = ["".join(ch.choices[0].text for ch in c.completions.create(
            model="tiny", prompt=p, max_tokens=16, temperature=0, stream=True)) for p in PROMPTS]
        assert streamed == want
        counts = routed(port)
        assert counts[0] >= 3 and counts[1] >= 3, counts
        titles = {cmdline(pid).split("\x00")[0].strip() for pid in descendants(node1.pid)}
        assert "nanovllm_tp::dp1::tp0" in titles, titles
        node0.send_signal(signal.SIGTERM)              # torchrun passes it on to rank 0, which tells replica 1
        node0.wait(timeout=60)
        assert node1.wait(timeout=60) == 0, open(tmp_path / "node1.log").read()[-3000:]


def test_torchrun_on_one_node_two_replicas_of_two_ranks(tiny_model_dir, tiny_llm):
    """D=2 x T=2 as four torchrun ranks on one node, no secret given: each replica's two ranks form a group of
    their own, replica 1 reaches the HTTP process over CURVE keys from a secret rank 0 made, and answers match."""
    port = free_port()
    cmd = python_cmd(*TORCHRUN, "--standalone", "--nproc-per-node", "4", "-m", "nanovllm_tp.launch.serve",
                     "--model", tiny_model_dir, "--port", str(port), "--served-model-name", "tiny", *ENGINE_ARGS,
                     "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--router", "round-robin")
    env = {k: "" for k in ("NANOVLLM_TP_SECRET", "NANOVLLM_TP_SECRET_FILE")}
    with started(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        wait_all_ready(port, proc)
        c = client(port)
        want = [o.outputs[0].text for o in offline(tiny_llm, PROMPTS)]
        assert [c.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text
                for p in PROMPTS * 2] == want * 2
        assert routed(port) == {0: len(PROMPTS), 1: len(PROMPTS)}
        pids = [proc.pid, *descendants(proc.pid)]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert wait_gone(pids, 30) is not None


@pytest.mark.parametrize("world,per_node,tp,why", [
    (4, 4, 1, "needs 2 ranks, and torchrun started 4"),
    (4, 1, 2, "must be a multiple of --tensor-parallel-size"),
])
def test_a_torchrun_launch_that_does_not_fit_is_refused(monkeypatch, world, per_node, tp, why):
    from nanovllm_tp.distributed import torchrun_replicas
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=why):
        torchrun_replicas.place(world // tp if why.startswith("must") else 2, tp)


def test_embeddings_tokenize_and_aborts_through_the_router(tiny_model_dir, tmp_path):
    """Embeddings on either replica equal transformers' pooling; /tokenize answers; a client that disconnects
    has its request aborted on the replica that ran it."""
    import torch
    from transformers import AutoModel
    from tests.embedding_helpers import cosine, hf_embedding, model_copy
    model = model_copy(tiny_model_dir, str(tmp_path / "mean"), "pooling_mode_mean_tokens")
    hf = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    port, ctx = start_server(model, "--data-parallel-size", "2", "--router", "round-robin", "--max-model-len",
                             "4096", "--http-priority", "normal")
    with ctx as proc:
        wait_all_ready(port, proc)
        c = client(port)
        prompt = [5, 9, 33, 2, 71]
        for _ in range(2):                                  # one on each replica
            got = c.embeddings.create(model="tiny", input=prompt, encoding_format="float").data[0].embedding
            assert cosine(got, hf_embedding(hf, prompt, "MEAN")) >= 0.9999
        tokens = httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"model": "tiny", "prompt": "hello world"},
                            timeout=30).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data:"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = metrics(port)
            running = [v for k, v in m.items() if k.startswith("num_requests_running{")]
            aborted = sum(v for k, v in m.items() if k.startswith("request_success_total{")
                          and 'finished_reason="abort"' in k)
            if aborted == 1 and not any(running):
                break
            time.sleep(0.1)
        assert aborted == 1 and not any(running), m
        assert sum(v for k, v in m.items() if k.startswith("generation_tokens_total{")) < 4000


def test_torchrun_a_replica_that_cannot_start_stops_the_server_with_its_reason(tiny_model_dir, tmp_path):
    """Node 1 is given a model path that does not exist: rank 0 stops waiting for it at once and says why."""
    port, master = free_port(), free_port()
    secret = {"NANOVLLM_TP_SECRET": "two-node-replicas-secret-0123456789abcdef"}
    nodes = [python_cmd(*TORCHRUN, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                        "--master-addr", "127.0.0.1", "--master-port", str(master),
                        "-m", "nanovllm_tp.launch.serve", "--model", model, "--port", str(port), *ENGINE_ARGS,
                        "--data-parallel-size", "2") for n, model in ((0, tiny_model_dir), (1, str(tmp_path / "no")))]
    log = tmp_path / "node0.log"
    with started(nodes[1], env=secret, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), \
            started(nodes[0], env=secret, stdout=open(log, "w"), stderr=subprocess.STDOUT) as node0:
        assert node0.wait(timeout=120) != 0
    assert "replica 1 could not start" in log.read_text(), log.read_text()[-3000:]
