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

from tests.procs import cmdline, descendants
from tests.serving.test_data_parallel import replicas, wait_all_ready
from tests.serving.test_replica_lifecycle import assert_all_gone
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


def sigterm_exits_0(proc) -> None:
    """SIGTERM to the server: it exits 0, and no process, shared memory or sockets' directory of it is left."""
    pids = [proc.pid, *descendants(proc.pid)]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert_all_gone(proc, pids)


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


def test_a_pipeline_stage_killed_while_idle_is_seen_and_the_server_stays_up(tiny_model_dir, tmp_path):
    """-pp 2, nothing running: kill -9 of stage 1. /health answers 503 naming the rank within seconds, requests
    get a clean 503, the server keeps answering (no traceback, no exit) until SIGTERM, which it obeys with 0."""
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
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
            sigterm_exits_0(proc)
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]


def sse_events(port: int, route: str, body: dict, timeout: float = 120) -> list:
    """Every event of a streamed request, raw: the parsed JSON bodies, and "[DONE]" as itself."""
    events = []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/{route}", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


N_BODY = {"model": "tiny", "n": 4, "temperature": 1.0, "seed": 3, "max_tokens": 30, "stop": [" t"], "stream": True}


def check_one_finish_per_choice(events: list, n: int, text_key, staggered: bool = True) -> None:
    """Each choice's finish_reason comes once, in its last chunk, and the stream ends with [DONE]; `staggered`:
    the choices end at different steps (the case that repeated the finished ones)."""
    assert events[-1] == "[DONE]"
    finishes, last_text = {}, {}
    for k, ev in enumerate(events[:-1]):
        for ch in ev["choices"]:
            assert ch["index"] not in finishes, f"choice {ch['index']} after its finish: {ev}"
            if ch.get("finish_reason") is not None:
                finishes[ch["index"]] = k
            if text_key(ch):
                last_text[ch["index"]] = k
    assert sorted(finishes) == list(range(n))
    assert not staggered or len(set(finishes.values())) > 1, "every choice ended in one chunk: the case is not run"


@pytest.mark.parametrize("extra", [(), ("--pipeline-parallel-size", "2")], ids=["pp1", "pp2"])
def test_streamed_choices_finish_once_each(tiny_model_dir, extra):
    """n = 4 streamed, choices ending at different steps: once a choice has finished no later chunk carries it
    (OpenAI's and vLLM's streams: one finish per choice), completions and chat, with and without stages."""
    port, ctx = start_server(tiny_model_dir, *extra)
    with ctx as proc:
        wait_ready(port, proc)
        events = sse_events(port, "completions", {**N_BODY, "prompt": "Once upon a time there"})
        check_one_finish_per_choice(events, 4, lambda ch: ch["text"])
        events = sse_events(port, "chat/completions",
                            {**N_BODY, "messages": [{"role": "user", "content": "Once upon a time there"}]})
        check_one_finish_per_choice(events, 4, lambda ch: ch["delta"].get("content"))


def test_a_stream_cut_by_a_dead_rank_ends_with_an_error_event_then_done(tiny_model_dir):
    """-pp 2, a long stream running: kill -9 of stage 1. The stream's last events are an error (503) and
    [DONE], as vLLM ends a stream it cannot finish."""
    port, ctx = start_server(tiny_model_dir, "--pipeline-parallel-size", "2", "--max-model-len", "4096")
    with ctx as proc:
        wait_ready(port, proc)
        victim = titled(proc.pid, "nanovllm_tp::tp1")
        events = []
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if len(events) == 2:
                        os.kill(victim, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == 503 and "rank 1" in events[-2]["error"]["message"], events[-2]
        assert all("choices" in ev for ev in events[:-2])


SYSTEM = "You are a helpful assistant. Answer briefly and kindly, in plain words, and never make things up."


def test_the_router_queues_nowhere_while_another_replica_has_a_free_slot(tiny_model_dir):
    """-dp 2 --max-num-seqs 4, 16 chat streams that share a short system prompt (a few blocks, like a chat
    template's): sampled every 50 ms (as fast as the HTTP process answers beside busy engines), no replica
    has a request waiting while the other has a free slot for longer than a second (a step or two, and the
    figures' lag; patience alone left 7 waiting on one replica against 1 on the other for seconds)."""
    import threading
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--max-num-seqs", "4",
                             "--max-model-len", "1024", "--http-priority", "normal")    # figures sampled often
    with ctx as proc:
        wait_all_ready(port, proc)
        samples, done = [], threading.Event()

        def sample():
            pattern = re.compile(r'nanovllm_tp:num_requests_(running|waiting)\{dp_rank="(\d)",model_name="tiny"\} '
                                 r'(\S+)')
            while not done.is_set():
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
                figures = {(kind, int(rank)): float(v) for kind, rank, v in pattern.findall(text)}
                samples.append((time.monotonic(), figures))
                time.sleep(0.05)

        def chat(i):           # a closed loop, until the figures were sampled often enough (a slow /metrics)
            until = time.monotonic() + 120
            while True:
                body = {"model": "tiny", "max_tokens": 800, "ignore_eos": True, "temperature": 0,
                        "messages": [{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": f"story number {i}: once upon a time"}]}
                r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=300)
                assert r.status_code == 200, r.text
                if len(samples) >= 12 or time.monotonic() > until:
                    return
        watcher = threading.Thread(target=sample)
        watcher.start()
        clients = [threading.Thread(target=chat, args=(i,)) for i in range(16)]
        for c in clients:
            c.start()
        for c in clients:
            c.join(300)
        done.set()
        watcher.join(30)
    stranded = [t for t, f in samples if any(f.get(("waiting", a), 0) > 0 and f.get(("running", 1 - a), 0) +
                                             f.get(("waiting", 1 - a), 0) < 4 for a in (0, 1))]
    worst, since, last = 0.0, None, None
    for t, _ in samples:                 # the longest run of consecutive stranded samples
        since = (since if last in stranded else t) if t in stranded else None
        worst, last = (max(worst, t - since) if since is not None else worst), t
    assert len(samples) >= 5
    print(f"stranded in {len(stranded)} of {len(samples)} samples, at most {worst:.2f} s in a row")
    assert len(stranded) <= 2 and worst < 1.0, \
        f"requests waited on one replica while the other had a free slot in {len(stranded)} of {len(samples)} " \
        f"samples, {worst:.1f} s in a row"


@pytest.fixture(scope="module")
def invariant_llm(tiny_model_dir):
    """The server's engine, offline, under batch_invariant: what an undisturbed run answers."""
    from nanovllm_tp import LLM
    llm = LLM(tiny_model_dir, batch_invariant=True, max_model_len=1024, kv_cache_memory=32 << 20,
              kvcache_block_size=16)
    yield llm
    llm.close()


def running_on(port: int) -> int | None:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    busy = [int(r) for r, v in re.findall(r'nanovllm_tp:num_requests_running\{dp_rank="(\d)",model_name="tiny"\} '
                                          r'(\S+)', text) if float(v) > 0]
    return busy[0] if len(busy) == 1 else None


@pytest.mark.parametrize("tp, victim_rank", [("1", 0), ("2", 1)], ids=["dp2-kill-replica", "dp2-tp2-kill-rank1"])
def test_a_stream_survives_the_death_of_its_replica(tiny_model_dir, invariant_llm, tp, victim_rank):
    """-dp 2 --batch-invariant, a streamed n = 2 seeded request: its replica (or a rank of it) killed with -9 after a
    few chunks, the stream goes on from another replica with no error and no repeated text; each choice's text is
    that of an undisturbed run, token for token, one finish each, then [DONE]."""
    from nanovllm_tp import SamplingParams
    body = {"model": "tiny", "prompt": "Once upon a time there", "n": 2, "temperature": 0.8, "seed": 7,
            "max_tokens": 700, "ignore_eos": True, "stream": True}
    want = invariant_llm.generate([body["prompt"]], SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=700,
                                                                   ignore_eos=True), use_tqdm=False)[0]
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--tensor-parallel-size", tp,
                             "--batch-invariant", "--max-model-len", "1024")
    with ctx as proc:
        wait_all_ready(port, proc)
        events, texts, killed = [], {0: "", 1: ""}, None
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                if data != "[DONE]":
                    for ch in events[-1].get("choices", []):
                        texts[ch["index"]] += ch["text"]
                if len(events) == 4 and killed is None:
                    replica = running_on(port)
                    assert replica is not None
                    killed = titled(proc.pid, f"nanovllm_tp::dp{replica}::tp{victim_rank}")
                    os.kill(killed, signal.SIGKILL)
        assert killed is not None and events[-1] == "[DONE]"
        assert not [e for e in events[:-1] if "error" in e], [e for e in events if "error" in e]
        check_one_finish_per_choice(events, 2, lambda ch: ch["text"], staggered=False)
        assert texts == {c.index: c.text for c in want.outputs}
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert re.search(r'nanovllm_tp:router_requests_resumed_total\{model_name="tiny"\} 1\.0', text), text


def test_sighup_restarts_every_replica_under_load_with_no_failed_request(tiny_model_dir, invariant_llm, tmp_path):
    """-dp 2 --batch-invariant under 8 streams: SIGHUP to the server restarts replica 0, then replica 1 (new
    processes, one at a time); every request completes, each answer equal to the undisturbed engine's, and the
    streams running on a restarting replica move to the other with their KV."""
    from nanovllm_tp import SamplingParams
    from nanovllm_tp.bench import chaos
    want = {p: o.outputs[0].text for p, o in zip(chaos.PROMPTS, invariant_llm.generate(
        chaos.PROMPTS, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True), use_tqdm=False))}
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--batch-invariant",
                                 "--max-model-len", "1024", stderr=err)
        with ctx as proc:
            wait_all_ready(port, proc)
            before = replicas(proc.pid)
            streams = chaos.Streams(f"http://127.0.0.1:{port}/v1", 8, 300, want)
            streams.start()
            time.sleep(2.0)
            proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and "every replica restarted" not in log.read_text():
                time.sleep(0.2)
            time.sleep(1.0)
            streams.stop.set()
            assert streams.join(300)
            after = replicas(proc.pid)
            resumed = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            sigterm_exits_0(proc)
    text = log.read_text()
    assert "rolling restart: every replica restarted" in text, text[-3000:]
    assert text.index("replica 0 stops") < text.index("replica 0 serves again") < text.index("replica 1 stops")
    assert sorted(after) == [0, 1] and all(after[i] != before[i] for i in (0, 1))
    results = streams.results
    assert len(results) > 8 and all(r["ok"] for r in results), [r["why"] for r in results if not r["ok"]][:5]
    assert all(r["equal"] for r in results)
    moved = sum(float(v) for v in re.findall(r'router_requests_(?:resumed|resubmitted)_total\{[^}]*\} (\S+)', resumed))
    assert moved >= 1
    # the streams of a restarting replica move with their KV (not computed again), and equal the undisturbed run's
    migrated = float(re.search(r'router_requests_migrated_total\{[^}]*\} (\S+)', resumed).group(1))
    assert migrated >= 1 and float(re.search(r'router_kv_migrated_bytes_total\{[^}]*\} (\S+)', resumed).group(1)) > 0
    assert "moved with their KV" in text and "computes its KV again" not in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.parametrize("after", [0.3, 1.0])
def test_sigterm_during_a_rolling_restart_stops_cleanly(tiny_model_dir, tmp_path, after):
    """SIGTERM `after` seconds into a rolling restart under 8 streams (a replica on its way out, its requests
    moving, or its successor loading): the server exits 0 with nothing left, every request answered with a
    stream or a 503, never a 500 (a request waiting for a replica while every one is down for good gets its 503
    at once, not a cancelled handler)."""
    from nanovllm_tp.bench import chaos
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--max-model-len", "1024", stderr=err)
        with ctx as proc:
            wait_all_ready(port, proc)
            streams = chaos.Streams(f"http://127.0.0.1:{port}/v1", 8, 800, None)
            streams.start()
            time.sleep(1.0)
            proc.send_signal(signal.SIGHUP)
            time.sleep(after)
            sigterm_exits_0(proc)
            streams.stop.set()
            assert streams.join(60)
    text = log.read_text()
    assert "rolling restart: replica 0 stops" in text and "did not stop cleanly" not in text, text[-3000:]
    assert " 500 " not in text and "Traceback" not in text, text[-3000:]
    assert not [r["why"] for r in streams.results if r["why"] and "HTTP 500" in r["why"]]


def test_sighup_to_a_one_engine_server_is_ignored_with_a_line(tiny_model_dir, tmp_path):
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        port, ctx = start_server(tiny_model_dir, stderr=err)
        with ctx as proc:
            wait_ready(port, proc)
            proc.send_signal(signal.SIGHUP)
            time.sleep(1.0)
            assert proc.poll() is None
            assert client(port, "none").completions.create(model="tiny", prompt="hi",
                                                           max_tokens=4).usage.completion_tokens == 4
    text = log.read_text()
    assert "SIGHUP: a rolling restart needs --data-parallel-size 2 or more" in text
