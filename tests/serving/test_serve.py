"""The OpenAI server as its users meet it: a real server process on a free port of 127.0.0.1, driven with the
official `openai` client (and raw HTTP where the client hides what is checked)."""
import asyncio
import contextlib
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import pytest

from nanovllm_tp import SamplingParams
from tests.helpers import GGUF, smollm2
from tests.procs import (GONE_WITHIN, free_port, our_shm_segments, processes_of, python_cmd, started,
                         wait_gone)

pytestmark = pytest.mark.spawn     # a server process, or several

KEY = "test-key"
PROMPTS = ["The quick brown fox", "Hello, my name is", "In the beginning", "Once upon a time there"]
ENGINE_ARGS = ["--block-size", "16", "--kv-cache-memory", str(32 << 20), "--max-model-len", "512"]


def start_server(model_dir: str, *extra: str, stderr=None):
    """(port, a context manager of the server process: SIGTERM when it ends, then everything left is killed).
    `stderr`: a file for the server's log (default: discarded)."""
    port = free_port()
    cmd = python_cmd("-m", "nanovllm_tp.launch.serve", "--model", model_dir, "--port", str(port),
                     "--served-model-name", "tiny", *ENGINE_ARGS, *extra)

    @contextlib.contextmanager
    def run():
        with started(cmd, stdout=open(os.devnull, "w"), stderr=stderr or open(os.devnull, "w")) as proc:
            try:
                yield proc
            finally:
                stop_server(proc)
    return port, run()


def stop_server(proc) -> None:
    """SIGTERM to a test's server (if it still runs), a wait for it, and no sockets' directory left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=GONE_WITHIN)
    assert not rundirs(proc.pid), "the server left its sockets"


@contextlib.contextmanager
def served(model_dir: str, *extra: str):
    """A started server's base URL (http://127.0.0.1:PORT), for as long as the block runs."""
    port, ctx = start_server(model_dir, *extra)
    with ctx as proc:
        wait_ready(port, proc)
        yield f"http://127.0.0.1:{port}"


def rundirs(pid: int) -> list[str]:
    """The socket directories a server process made (it removes them on every exit it lives through)."""
    return glob.glob(os.path.join(tempfile.gettempdir(), f"nanovllm_tp-serve-{pid}-*"))


def wait_ready(port: int, proc, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the server did not come up")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    port, ctx = start_server(tiny_model_dir, "--api-key", KEY)
    with ctx as proc:
        wait_ready(port, proc)
        yield port


def client(port: int, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)


def metrics(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        m = re.match(r'^nanovllm_tp:(\w+)(\{[^}]*\})? ([0-9.eE+-]+)$', line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def offline(tiny_llm, prompts, **kw):
    params = SamplingParams(**{"temperature": 0, "max_tokens": 16, **kw})
    return tiny_llm.generate(prompts, params, use_tqdm=False)


def test_completions_equal_offline_generate_streamed_or_not(server, tiny_llm):
    c = client(server)
    want = offline(tiny_llm, PROMPTS)
    got = c.completions.create(model="tiny", prompt=PROMPTS, max_tokens=16, temperature=0)
    assert [ch.text for ch in got.choices] == [o.outputs[0].text for o in want]
    assert [ch.finish_reason for ch in got.choices] == [o.outputs[0].finish_reason for o in want]
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)
    assert got.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in want)
    texts, usage = {}, None
    counted = metrics(server)['prompt_tokens_total{model_name="tiny"}']
    for chunk in c.completions.create(model="tiny", prompt=PROMPTS, max_tokens=16, temperature=0, stream=True,
                                      stream_options={"include_usage": True}):
        if not chunk.choices:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert [texts[i] for i in range(len(PROMPTS))] == [ch.text for ch in got.choices]
    assert usage.total_tokens == got.usage.total_tokens     # the prompt travels with a request's first output only
    assert metrics(server)['prompt_tokens_total{model_name="tiny"}'] - counted == got.usage.prompt_tokens
    echo = "".join(ch.choices[0].text for ch in c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16,
                                                                      temperature=0, stream=True, echo=True))
    assert echo == PROMPTS[0] + want[0].outputs[0].text


def test_n_stop_logprobs_and_echo(server, tiny_llm):
    c = client(server)
    base = offline(tiny_llm, PROMPTS[:1], max_tokens=24)[0].outputs[0]
    stop = base.text[5:8]
    got = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    assert got.choices[0].text == base.text[:base.text.index(stop)] and got.choices[0].finish_reason == "stop"
    hot = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=2, seed=3)
    want = tiny_llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=8),
                             use_tqdm=False)[0]
    assert [ch.index for ch in hot.choices] == [0, 1]
    assert [ch.text for ch in hot.choices] == [o.text for o in want.outputs]
    lp = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    ref = offline(tiny_llm, PROMPTS[:1], max_tokens=4, logprobs=2)[0].outputs[0]
    got_lp = lp.choices[0].logprobs
    assert got_lp.token_logprobs == pytest.approx([p[t].logprob for t, p in zip(ref.token_ids, ref.logprobs)])
    assert all(len(top) == 2 for top in got_lp.top_logprobs)
    echo = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPTS[0] + ref.text


def test_stream_interval_sends_tokens_in_groups(server, tiny_llm):
    """vLLM's extra field: the first token at once, then groups of 4, the rest at the end (a client that lags gets
    several groups in one chunk, never a split one); the text is the offline greedy text."""
    want = offline(tiny_llm, PROMPTS[:1], max_tokens=30, ignore_eos=True)[0].outputs[0]
    counts, text = [], ""
    for chunk in client(server).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0,
                                                   logprobs=0, stream=True,
                                                   extra_body={"ignore_eos": True, "stream_interval": 4}):
        for ch in chunk.choices:
            text += ch.text
            counts.append((counts[-1] if counts else 0) + len(ch.logprobs.tokens if ch.logprobs else []))
    assert text == want.text and counts[-1] == 30
    assert all(n % 4 == 1 for n in counts[:-1]), counts


def test_chat_equals_offline_chat_streamed_or_not(server, tiny_llm):
    c = client(server)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = tiny_llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    got = c.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0, logprobs=True,
                                    top_logprobs=3)
    assert got.choices[0].message.content == want.outputs[0].text and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert len(got.choices[0].logprobs.content) == got.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 for e in got.choices[0].logprobs.content)
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == want.outputs[0].finish_reason


def stream_all(port: int, prompts: list[str], max_tokens: int, key: str = KEY) -> list[str]:
    """Every prompt streamed at once (greedy) through the async openai client; their texts, in order."""
    async def one(c, p):
        text = ""
        async for chunk in await c.completions.create(model="tiny", prompt=p, max_tokens=max_tokens, temperature=0,
                                                      stream=True):
            text += "".join(ch.text for ch in chunk.choices)
        return text

    async def run():
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0,
                                      timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    return asyncio.run(run())


def test_64_concurrent_streams_all_finish_right(server, tiny_llm):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(64)]
    want = [o.outputs[0].text for o in offline(tiny_llm, prompts, max_tokens=12)]
    assert stream_all(server, prompts, 12) == want


@pytest.mark.slow
def test_a_client_that_disconnects_has_its_request_aborted(tiny_model_dir):
    """The engine runs beside the HTTP process and can run far ahead of a client, so the request is long
    enough (4,000 tokens) that it cannot finish before the disconnect reaches it, and HTTP keeps normal priority
    (at idle priority, other work on a loaded machine can starve it until the engine is done)."""
    port, ctx = start_server(tiny_model_dir, "--max-model-len", "4096", "--http-priority", "normal")
    with ctx as proc:
        wait_ready(port, proc)
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert metrics(port)["num_requests_running{model_name=\"tiny\"}"] == 1
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = metrics(port)
            if m['num_requests_running{model_name="tiny"}'] == 0:
                break
            time.sleep(0.1)
        aborted = 'request_success_total{finished_reason="abort",model_name="tiny"}'
        assert m['num_requests_running{model_name="tiny"}'] == 0 and m['kv_cache_usage_perc{model_name="tiny"}'] == 0
        assert m[aborted] == 1
        assert m['generation_tokens_total{model_name="tiny"}'] < 4000


@pytest.mark.parametrize("body,status,message", [
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature must be >= 0.0"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": 17}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p must be > 0"),
    ({"model": "tiny", "prompt": "word " * 600}, 400, "max_model_len=512"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
    ({"model": "tiny", "prompt": "x", "stop": ""}, 400, "stop cannot contain an empty string"),
    ({"model": "tiny", "prompt": "x", "stream_interval": 0}, 400, "stream_interval must be >= 1"),
])
def test_bad_requests_get_the_right_status_and_the_server_keeps_serving(server, body, status, message):
    r = httpx.post(f"http://127.0.0.1:{server}/v1/completions", json=body, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status and message in r.json()["error"]["message"]
    assert client(server).completions.create(model="tiny", prompt="ok", max_tokens=2).choices[0].text is not None


def test_api_key_is_required(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").models.list()
    assert httpx.get(f"http://127.0.0.1:{server}/v1/models", timeout=10).status_code == 401
    assert [m.id for m in client(server).models.list()] == ["tiny"]
    assert httpx.get(f"http://127.0.0.1:{server}/health", timeout=10).status_code == 200
    assert httpx.get(f"http://127.0.0.1:{server}/version", timeout=10).json()["version"]


@pytest.mark.slow
def test_tp2_server_same_outputs_then_a_dead_rank_gives_503_and_sigterm_leaves_nothing(tiny_model_dir, tiny_llm):
    port, ctx = start_server(tiny_model_dir, "--tp", "2")
    with ctx as proc:
        wait_ready(port, proc)
        c = client(port, key="unused")
        got = c.completions.create(model="tiny", prompt=PROMPTS, max_tokens=16, temperature=0)
        assert [ch.text for ch in got.choices] == [o.outputs[0].text for o in offline(tiny_llm, PROMPTS)]
        worker = processes_of(proc.pid, "worker")[0]
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data:"))
            assert "text" in next(lines)
            os.kill(worker, signal.SIGKILL)      # an open stream ends with an error event
            rest = list(lines)
        assert len(rest) >= 2 and "error" in json.loads(rest[-2][5:]) and rest[-1] == "data: [DONE]"
        deadline = time.monotonic() + 20
        status = None
        while time.monotonic() < deadline:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": "x", "max_tokens": 4})
            status = r.status_code
            if status == 503:
                break
            time.sleep(0.2)
        assert status == 503 and httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 503
        os.kill(proc.pid, signal.SIGTERM)
        assert wait_gone([proc.pid], 15) is not None
    assert not {s for s in our_shm_segments() if s.startswith(f"nvtp_{proc.pid}_")}


@pytest.mark.slow
def test_pp2_server_streams_equal_offline_and_a_disconnect_in_flight_is_aborted(tiny_model_dir, tiny_llm):
    """Two pipeline stages with a micro-batch each behind the OpenAI server: 16 concurrent streams answer as the
    offline TP 1 engine does; a client that leaves while its request has steps in flight is aborted (when its step's
    results are back), a request running beside it finishes whole, and nothing is left holding KV."""
    port, ctx = start_server(tiny_model_dir, "-pp", "2", "--max-model-len", "4096", "--http-priority", "normal")
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(16)]
    want = [o.outputs[0].text for o in offline(tiny_llm, prompts, max_tokens=12)]
    with ctx as proc:
        wait_ready(port, proc)
        assert stream_all(port, prompts, 12, key="unused") == want
        survivor = {}

        def run_survivor():
            survivor["out"] = client(port, key="unused").completions.create(
                model="tiny", prompt=PROMPTS[2], max_tokens=300, temperature=0, extra_body={"ignore_eos": True})

        thread = threading.Thread(target=run_survivor)
        thread.start()
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data:"))
        thread.join(timeout=120)
        assert survivor["out"].usage.completion_tokens == 300
        assert survivor["out"].choices[0].text == offline(tiny_llm, [PROMPTS[2]], max_tokens=300,
                                                          ignore_eos=True)[0].outputs[0].text
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = metrics(port)
            if m['num_requests_running{model_name="tiny"}'] == 0:
                break
            time.sleep(0.1)
        assert m['num_requests_running{model_name="tiny"}'] == 0 and m['kv_cache_usage_perc{model_name="tiny"}'] == 0
        assert m['request_success_total{finished_reason="abort",model_name="tiny"}'] == 1
        assert m['generation_tokens_total{model_name="tiny"}'] < 16 * 12 + 300 + 4000


@pytest.mark.slow
def test_sigterm_stops_a_tp2_server_and_its_worker(tiny_model_dir):
    port, ctx = start_server(tiny_model_dir, "--tp", "2")
    with ctx as proc:
        wait_ready(port, proc)
        pids = [proc.pid, *_children(proc.pid)]
        os.kill(proc.pid, signal.SIGTERM)
        assert wait_gone(pids, 15) is not None
    assert not {s for s in our_shm_segments() if s.startswith(f"nvtp_{proc.pid}_")}


def _children(pid: int) -> list[int]:
    from tests.procs import descendants
    return descendants(pid)


@pytest.mark.slow
def test_beyond_max_waiting_requests_new_ones_get_429(tiny_model_dir):
    # the running request lasts its whole 4095 tokens (seconds, more on a loaded machine), and HTTP keeps normal
    # priority, so that other work on the machine cannot starve it while the engine runs
    port, ctx = start_server(tiny_model_dir, "--max-num-seqs", "1", "--max-waiting-requests", "1",
                             "--max-model-len", "4096", "--http-priority", "normal")
    with ctx as proc:
        wait_ready(port, proc)
        url = f"http://127.0.0.1:{port}/v1/completions"
        long = {"model": "tiny", "prompt": "a", "max_tokens": 4095, "ignore_eos": True}

        async def run():
            async with httpx.AsyncClient(timeout=60) as http:
                async with http.stream("POST", url, json={**long, "stream": True}) as running:
                    lines = running.aiter_lines()
                    while not (await lines.__anext__()).startswith("data:"):
                        pass                                   # the first request runs (max_num_seqs 1)
                    waiting = asyncio.ensure_future(http.post(url, json={**long, "max_tokens": 2}))
                    deadline = time.monotonic() + 60
                    while metrics(port)['num_requests_waiting{model_name="tiny"}'] != 1:
                        assert time.monotonic() < deadline, "the second request never queued behind the first"
                        await asyncio.sleep(0.1)           # the second one waits behind it
                    assert metrics(port)['num_requests_running{model_name="tiny"}'] == 1
                    refused = await http.post(url, json={**long, "max_tokens": 2})
                await asyncio.sleep(0)
                return refused, await waiting

        refused, waited = asyncio.run(run())
        assert refused.status_code == 429 and "max-waiting-requests" in refused.json()["error"]["message"]
        assert waited.status_code == 200 and waited.json()["usage"]["completion_tokens"] == 2


def _frontend(pid: int) -> int:
    return processes_of(pid, "http")[0]


HTTP_DEATH_SEEN_WITHIN = 10.0      # seconds from kill -9 of the HTTP process to the engine process's exit


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["auto", "c+onednn"])
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "streaming"])
def test_the_engine_process_exits_when_its_http_process_dies(tiny_model_dir, kernels, busy):
    """kill -9 of the HTTP process, idle or while a stream runs: the engine process sees it within seconds and
    exits, under either kernel table (this CPU's, or the one an AMX CPU measures). A send on the outputs socket
    whose peer is gone would block for ever (ZMQ PUSH): a stream sends every step, so it hit that every time."""
    port, ctx = start_server(tiny_model_dir, "--packed-linear", kernels)
    with ctx as proc:
        wait_ready(port, proc)
        front = _frontend(proc.pid)
        if busy:
            stream = client(port).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=400, stream=True,
                                                     temperature=0, extra_body={"ignore_eos": True})
            next(iter(stream))
        os.kill(front, signal.SIGKILL)
        start = time.monotonic()
        assert proc.wait(timeout=GONE_WITHIN) != 0
        assert time.monotonic() - start < HTTP_DEATH_SEEN_WITHIN
        assert not rundirs(proc.pid)


@pytest.mark.slow
def test_the_http_process_exits_when_the_engine_process_is_killed(tiny_model_dir):
    port, ctx = start_server(tiny_model_dir)
    with ctx as proc:
        wait_ready(port, proc)
        front = _frontend(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        assert wait_gone([front], 15) is not None
        assert not rundirs(proc.pid)


@pytest.mark.slow
def test_torchrun_tp2_server_same_outputs_and_sigterm_leaves_nothing(tiny_model_dir, tiny_llm, tmp_path):
    """`./torchrun.sh 2 -m nanovllm_tp.launch.serve --tp 2`: rank 0 serves HTTP (one HTTP process), rank 1 plans.
    SIGTERM to torchrun: one line from each rank and one from torchrun, no traceback."""
    port = free_port()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [os.path.join(repo, "torchrun.sh"), "2", "-m", "nanovllm_tp.launch.serve", "--tp", "2", "--model",
           tiny_model_dir, "--port", str(port), "--served-model-name", "tiny", *ENGINE_ARGS]
    log = tmp_path / "stderr"
    # the running interpreter, not whichever python3 is first on PATH (outside an activated venv, not this one)
    with started(cmd, env={"PYTHON": sys.executable}, cwd=repo, stdout=open(os.devnull, "w"),
                 stderr=open(log, "w")) as proc:
        wait_ready(port, proc)
        fronts = processes_of(proc.pid, "http")
        assert len(fronts) == 1
        got = client(port, key="unused").completions.create(model="tiny", prompt=PROMPTS, max_tokens=16,
                                                            temperature=0)
        assert [ch.text for ch in got.choices] == [o.outputs[0].text for o in offline(tiny_llm, PROMPTS)]
        pids = [proc.pid, *_children(proc.pid)]
        os.kill(proc.pid, signal.SIGTERM)
        assert wait_gone(pids, 30) is not None
        assert not [d for p in pids for d in rundirs(p)]
        assert proc.wait() == 143
    text = log.read_text()
    assert "Traceback" not in text, text
    assert [text.count(f"rank {r}: stopped by SIGTERM") for r in (0, 1)] == [1, 1], text
    assert text.count("torchrun: stopped by SIGTERM") == 1


@pytest.mark.slow
def test_on_cpu_the_http_process_runs_on_what_the_engine_leaves_idle(tiny_model_dir, monkeypatch):
    """Without --threads or OMP_NUM_THREADS the engine takes every core and the HTTP process (every thread of it)
    runs at idle priority; libgomp's spin before sleeping is short (GOMP_SPINCOUNT, set before torch loads it:
    importing the command does not import torch)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    probe = subprocess.run([sys.executable, "-c", "import sys, nanovllm_tp.launch.serve; print('torch' in sys.modules)"],
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "False"
    port, ctx = start_server(tiny_model_dir)
    with ctx as proc:
        wait_ready(port, proc)
        text = client(port).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4).choices[0].text
        assert text
        front = _frontend(proc.pid)
        assert {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{front}/task")} == {os.SCHED_IDLE}
        assert {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{proc.pid}/task")} == {os.SCHED_OTHER}
        env = dict(e.split("=", 1) for e in open(f"/proc/{front}/environ").read().split("\0") if "=" in e)
        assert env["GOMP_SPINCOUNT"] == "10000" and env["OMP_NUM_THREADS"] == str(len(os.sched_getaffinity(0)))
    port, ctx = start_server(tiny_model_dir, "--http-priority", "normal")      # on a shared machine
    with ctx as proc:
        wait_ready(port, proc)
        front = _frontend(proc.pid)
        assert {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{front}/task")} == {os.SCHED_OTHER}


def test_request_priority_needs_the_priority_policy(server, tiny_model_dir, tiny_llm):
    """vLLM's `priority` body field: refused by name on a first-come-first-served server, served in order on one
    started with --scheduling-policy priority (outputs as offline)."""
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="scheduling_policy='priority'"):
        c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, extra_body={"priority": 1})
    assert c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, extra_body={"priority": 0}).choices
    port, ctx = start_server(tiny_model_dir, "--scheduling-policy", "priority")
    with ctx as proc:
        wait_ready(port, proc)
        got = [client(port).completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0,
                                               extra_body={"priority": rank}).choices[0].text
               for rank, p in zip((3, -1, 0, 7), PROMPTS)]
    assert got == [o.outputs[0].text for o in offline(tiny_llm, PROMPTS, max_tokens=8)]


def test_prefix_cache_counters_count_tokens_found_of_those_looked_up(server):
    """vLLM's prefix_cache_queries / prefix_cache_hits, in tokens: a prompt sent again finds its full blocks."""
    prompt = " ".join(f"word{i}" for i in range(60))
    before = metrics(server)
    for _ in range(2):
        client(server).completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    after = metrics(server)
    queries, hits = (after[f'prefix_cache_{k}_total{{model_name="tiny"}}'] -
                     before.get(f'prefix_cache_{k}_total{{model_name="tiny"}}', 0) for k in ("queries", "hits"))
    assert queries >= 2 * 60 and 16 <= hits < queries / 2


@smollm2
def test_batch_invariant_server_answers_alike_cold_on_a_hit_and_among_others():
    """--batch-invariant through the server: one seeded sampled request on SmolLM2 in bf16 gets the same tokens
    and logprobs cold, on a prefix hit, and sent together with 15 other requests (without the knob the hit and
    the company change its logprobs on this project's CPUs: tests/engine/test_batch_invariant.py)."""
    import random
    rng = random.Random(3)
    prompt = [rng.randrange(100, 49152) for _ in range(300)]
    others = [[rng.randrange(100, 49152) for _ in range(rng.randrange(20, 200))] for _ in range(15)]
    body = {"model": "tiny", "max_tokens": 24, "temperature": 0.8, "top_p": 0.95, "seed": 7, "logprobs": 2,
            "extra_body": {"ignore_eos": True}}

    def answer(c, p):
        choice = c.completions.create(prompt=p, **body).choices[0]
        return choice.logprobs.tokens, choice.logprobs.top_logprobs

    port, ctx = start_server(GGUF, "--batch-invariant", "--quantization", "none", "--dtype", "bfloat16",
                             "--kv-cache-memory", str(256 << 20))
    with ctx as proc:
        wait_ready(port, proc)
        c = client(port)
        cold = answer(c, prompt)
        hit = answer(c, prompt)

        async def together():
            ac = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                    timeout=300)
            got = await asyncio.gather(*(ac.completions.create(prompt=p, **body) for p in others + [prompt]))
            return got[-1].choices[0].logprobs.tokens, got[-1].choices[0].logprobs.top_logprobs
        among = asyncio.run(together())
        assert metrics(port)['prefix_cache_hits_total{model_name="tiny"}'] >= 256
    assert len(cold[0]) == 24
    assert hit == cold and among == cold
