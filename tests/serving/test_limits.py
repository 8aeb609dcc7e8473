"""No request holds the server hostage: its limits (each refused with a 4xx naming its flag), batches queued all or
none and cancelled whole, tokenization that costs only its own request, /health while the engine loop is
stuck, SIGTERM while a step is in flight. A real server on 127.0.0.1, raw HTTP where the client would hide it."""
import json
import os
import signal
import tempfile
import threading
import time

import httpx
import pytest

from nanovllm_tp.bench.hf import hf_greedy
from nanovllm_tp.bench.limits import MB, abandoned_batch, raw_post
from tests.procs import descendants, our_shm_segments, processes_of, wait_gone
from tests.serving.test_serve import ENGINE_ARGS, metrics, rundirs, start_server, wait_ready

pytestmark = pytest.mark.spawn
RUNNING, WAITING = 'num_requests_running{model_name="tiny"}', 'num_requests_waiting{model_name="tiny"}'
ABORTED = 'request_success_total{finished_reason="abort",model_name="tiny"}'


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    port, ctx = start_server(tiny_model_dir, "--engine-iteration-timeout", "3", "--http-priority", "normal")
    with ctx as proc:
        wait_ready(port, proc)
        yield port, proc


def post(port: int, body: dict, path: str = "/v1/completions", timeout: float = 60) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=timeout)


def small_request_seconds(port: int) -> float:
    start = time.monotonic()
    r = post(port, {"model": "tiny", "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    return time.monotonic() - start


def wait_for(cond, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return False


@pytest.mark.parametrize("body,flag", [
    ({"n": 1_000_000}, "--max-n"),
    ({"prompt": ["x"] * 2049}, "--max-prompts-per-request"),
    ({"prompt": ["x"] * 2048, "n": 3}, "--max-choices-per-request"),
    ({"stop": [f"s{i}" for i in range(33)]}, "--max-stop-strings"),
    ({"stop": ["y" * 1025]}, "--max-stop-string-chars"),
])
def test_each_limit_is_refused_at_once_by_name(server, body, flag):
    port, _ = server
    start = time.monotonic()
    r = post(port, {"model": "tiny", "prompt": "x", "max_tokens": 4, **body})
    assert r.status_code == 400 and flag in r.json()["error"]["message"], r.text
    assert time.monotonic() - start < 20            # the n = 1,000,000 request once locked the engine for minutes
    assert small_request_seconds(port) < 30


def test_a_body_over_the_limit_gets_413_before_it_is_read_and_costs_no_one_else(server):
    port, _ = server
    status, sent = raw_post(port, 50 * MB, chunked=False)        # Content-Length says it all
    assert status == 413 and sent < 50 * MB
    started_upload, result = threading.Event(), {}

    def upload():                                  # no length given: refused once 16 MiB have come in
        result["status"], result["sent"] = raw_post(port, 50 * MB, True, lambda n: n >= 2 * MB and
                                                    started_upload.set(), pace_s=0.05)
    t = threading.Thread(target=upload)
    t.start()
    assert started_upload.wait(30)
    during = small_request_seconds(port)          # served while the upload is in flight
    t.join(60)
    assert result["status"] == 413 and result["sent"] < 50 * MB
    assert during < 30
    big = {"model": "tiny", "prompt": "word " * (2 * MB), "max_tokens": 4}    # 10 MiB: within the body limit
    start = time.monotonic()
    r = post(port, big)
    assert r.status_code == 400 and "at least" in r.json()["error"]["message"], r.text   # refused untokenized
    assert time.monotonic() - start < 30
    assert small_request_seconds(port) < 30


def test_tokenizing_a_large_batch_costs_only_its_own_request(server):
    """2,047 prompts of 400 words, then one too long: all are tokenized (in the HTTP process's worker threads)
    before the batch is refused. A small request sent meanwhile is answered first."""
    port, _ = server
    body = {"model": "tiny", "prompt": [f"{i} " + "word " * 400 for i in range(2047)] + ["word " * 2000],
            "max_tokens": 1}
    done = {}

    def big():
        r = post(port, body, timeout=300)
        done["big"] = time.monotonic()
        done["answer"] = r
    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.5)
    small_request_seconds(port)
    done["small"] = time.monotonic()
    t.join(300)
    assert done["answer"].status_code == 400 and "prompt 2047 has" in done["answer"].json()["error"]["message"]
    assert done["small"] < done["big"]


FLOOD = "hello world " * 700_000           # 8.4 million characters: far beyond a 512-token context


def http_rss_mib(proc) -> float:
    """The resident memory of the server's HTTP process."""
    for pid in processes_of(proc.pid, "http"):
        try:
            with open(f"/proc/{pid}/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
        except OSError:
            continue
    raise AssertionError("no HTTP process")


def chat_seconds(port: int) -> float:
    start = time.monotonic()
    r = post(port, {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                    "ignore_eos": True}, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    return time.monotonic() - start


def test_huge_prompts_on_every_prompt_route_cost_no_one_else_and_no_memory(server):
    """Huge prompts sent at once to /tokenize (a prompt, a chat), /v1/completions and /v1/embeddings: each
    is held to the context before it is tokenized (an embedding cut to its last tokens reads only the end of its
    text), so a chat sent meanwhile is answered in seconds, and the HTTP process gives the memory back."""
    port, proc = server
    chat_seconds(port)
    before = http_rss_mib(proc)
    bodies = [("/tokenize", {"prompt": FLOOD}), ("/tokenize", {"prompt": FLOOD}),
              ("/tokenize", {"messages": [{"role": "user", "content": FLOOD}]}),
              ("/v1/completions", {"model": "tiny", "prompt": FLOOD, "max_tokens": 1}),
              ("/v1/embeddings", {"model": "tiny", "input": FLOOD, "truncate_prompt_tokens": -1})]
    answers = {}

    def send(i, path, body):
        start = time.monotonic()
        r = post(port, body, path, timeout=300)
        answers[i] = (r, time.monotonic() - start)
    threads = [threading.Thread(target=send, args=(i, *b)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    during = chat_seconds(port)
    for t in threads:
        t.join(300)
    for i in range(4):
        r, seconds = answers[i]
        assert r.status_code == 400 and "at least" in r.json()["error"]["message"], r.text[:300]
        assert seconds < 20
    embedding, seconds = answers[4]
    assert embedding.status_code == 200 and embedding.json()["usage"]["prompt_tokens"] == 512, embedding.text[:300]
    assert during < 10, f"a chat took {during:.1f} s beside the flood"
    time.sleep(1.0)
    after = http_rss_mib(proc)
    assert after < before + 150, f"the HTTP process grew from {before:.0f} to {after:.0f} MiB"


def test_an_embedding_cut_to_its_last_tokens_reads_only_the_end_of_its_text(server, tiny_llm):
    port, _ = server
    tok = tiny_llm.get_tokenizer()
    text = " ".join(f"w{i}" for i in range(40_000))          # ~230k characters, far more than the cut reads
    ids = tok.encode(text)[-100:]
    cut = post(port, {"model": "tiny", "input": text, "truncate_prompt_tokens": 100}, "/v1/embeddings")
    whole = post(port, {"model": "tiny", "input": ids}, "/v1/embeddings")
    assert cut.status_code == 200 and whole.status_code == 200, cut.text
    a, b = cut.json()["data"][0]["embedding"], whole.json()["data"][0]["embedding"]
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5


def test_the_tokenizer_threads_take_turns_between_requests(server):
    """Four large batches, each one request of 2,048 prompts (the last too long), then a small request: the two
    threads take one prompt of each request in turn, so the small one is answered before any batch. (Taken in
    order of arrival, it would wait for two batches whole.)"""
    port, _ = server
    body = {"model": "tiny", "prompt": [f"{i} " + "word " * 500 for i in range(2047)] + ["word " * 2000],
            "max_tokens": 1}
    done = {}

    def big(name):
        r = post(port, body, timeout=600)
        done[name] = (time.monotonic(), r)
    names = ("a", "b", "c", "d")
    threads = [threading.Thread(target=big, args=(n,)) for n in names]
    for t in threads:
        t.start()
    time.sleep(2.5)                   # the batches read and being tokenized
    small_request_seconds(port)
    small = time.monotonic()
    for t in threads:
        t.join(600)
    for name in names:
        finished, r = done[name]
        assert r.status_code == 400 and "prompt 2047 has" in r.json()["error"]["message"]
        assert small < finished, f"batch {name} was answered {small - finished:.1f} s before the small request"


def test_a_chat_template_sent_by_a_client_is_refused(server):
    port, _ = server
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}}
    r = post(port, body, "/v1/chat/completions")
    assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]
    del body["chat_template_kwargs"]
    assert post(port, body, "/v1/chat/completions").status_code == 200


@pytest.mark.parametrize("prompts,message", [
    (["Hello", "word " * 600], "prompt 1 has"),                # checked in the HTTP process
    ([[1, 2, 3], [1, 999_999]], "prompt 1: token id 999999"),  # checked by the engine, still all or none
])
def test_a_batch_with_one_bad_prompt_runs_none(server, prompts, message):
    port, _ = server
    before = metrics(port)
    r = post(port, {"model": "tiny", "prompt": prompts, "max_tokens": 200, "ignore_eos": True})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    time.sleep(1.0)                               # a prompt that had started would be running or counted by now
    after = metrics(port)
    assert after[RUNNING] == 0 and after[WAITING] == 0
    counted = 'prompt_tokens_total{model_name="tiny"}'
    assert after.get(counted, 0) == before.get(counted, 0)


def test_an_abandoned_batch_is_cancelled_whole(server):
    port, _ = server
    aborted = metrics(port).get(ABORTED, 0)
    assert abandoned_batch(port, 1500, max_tokens=300) < 30      # the client hangs up once the engine has them
    m = metrics(port)
    assert m[ABORTED] - aborted == 1500
    assert m['kv_cache_usage_perc{model_name="tiny"}'] == 0
    assert small_request_seconds(port) < 30


def test_a_stop_string_completed_by_the_last_allowed_token_ends_the_text(server, hf_model):
    """vLLM's rule: the text ends before the stop string and the reason is "stop", also when the token that
    completes it is the last one max_tokens allows. The greedy tokens are transformers'."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf_model.name_or_path)
    port, _ = server
    found = None
    for prompt in ("The quick brown fox", "Hello, my name is", "In the beginning", "Once upon a time there"):
        tokens = hf_greedy(hf_model, tok.encode(prompt), 12)
        for k in range(2, 13):
            before, full = tok.decode(tokens[:k - 1]), tok.decode(tokens[:k])
            new = full[len(before):].strip()
            if full.startswith(before) and new.isalnum() and new not in before:
                found = prompt, k, new, full[:full.index(new)]
                break
        if found:
            break
    assert found, "no prompt whose last allowed token completes a stop string"
    prompt, k, stop, want = found
    body = {"model": "tiny", "prompt": prompt, "max_tokens": k, "stop": [stop], "temperature": 0,
            "ignore_eos": True}
    choice = post(port, body).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (want, "stop", stop)
    text, reasons = "", []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["text"]
                    reasons.append(c["finish_reason"])
    assert text == want and reasons[-1] == "stop"


def test_health_says_503_while_the_engine_loop_is_stuck(server):
    port, proc = server
    os.kill(proc.pid, signal.SIGSTOP)             # the engine process: no step ends, no word to the HTTP process
    try:
        assert wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 503, 30)
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert "--engine-iteration-timeout" in r.json()["error"]["message"]
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200, 30)


def _serve(model_dir: str, log, *extra: str):
    """A server whose stderr goes to `log`: (port, the context of its process tree)."""
    return start_server(model_dir, "--http-priority", "normal", *extra, stderr=log)


def test_operator_flags_set_the_limits(tiny_model_dir):
    """--trust-request-chat-template renders the client's template; --max-n, --max-request-body-bytes and
    --disable-fastapi-docs take effect."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with tempfile.TemporaryFile("w+") as log:
        port, ctx = _serve(tiny_model_dir, log, "--trust-request-chat-template", "--max-n", "2",
                           "--max-request-body-bytes", "4096", "--disable-fastapi-docs")
        with ctx as proc:
            wait_ready(port, proc)
            template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2,
                    "chat_template_kwargs": {"chat_template": template}}
            r = post(port, body, "/v1/chat/completions")
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("<<hi there>>", add_special_tokens=False))
            r = post(port, {"model": "tiny", "prompt": "x", "max_tokens": 2, "n": 3})
            assert r.status_code == 400 and "at most 2 (--max-n)" in r.json()["error"]["message"]
            r = post(port, {"model": "tiny", "prompt": "x" * 5000, "max_tokens": 2})
            assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]
            for path in ("/docs", "/openapi.json"):
                assert httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10).status_code == 404


def test_sigterm_with_a_step_in_flight_ends_the_stream_and_exits_in_seconds(tiny_model_dir):
    with tempfile.TemporaryFile("w+") as log:
        port, ctx = _serve(tiny_model_dir, log)
        with ctx as proc:
            wait_ready(port, proc)
            pids = [proc.pid, *descendants(proc.pid)]
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
                lines = (line for line in r.iter_lines() if line.startswith("data:"))
                assert "text" in next(lines)
                os.kill(proc.pid, signal.SIGTERM)
                rest = list(lines)
            assert "shutting down" in json.loads(rest[-2][5:])["error"]["message"] and rest[-1] == "data: [DONE]"
            assert wait_gone(pids, 20) is not None
            assert proc.wait() in (0, 143)
            assert not rundirs(proc.pid)
        log.seek(0)
        text = log.read()
    assert "Traceback" not in text and "rank 0: stopped by SIGTERM" in text, text


@pytest.mark.slow
def test_a_stuck_step_gives_503_and_sigterm_still_stops_every_rank(tiny_model_dir):
    """TP 2 with rank 1 stopped (SIGSTOP): rank 0 waits in the step's all-reduce. /health turns 503, and SIGTERM
    does not wait for the step: every rank is killed after --shutdown-timeout, nothing shared is left."""
    with tempfile.TemporaryFile("w+") as log:
        port, ctx = _serve(tiny_model_dir, log, "--tp", "2", "--engine-iteration-timeout", "2",
                           "--shutdown-timeout", "3")
        with ctx as proc:
            wait_ready(port, proc)
            pids = [proc.pid, *descendants(proc.pid)]
            worker = processes_of(proc.pid, "worker")[0]
            os.kill(worker, signal.SIGSTOP)
            events = []

            def stream():
                body = {"model": "tiny", "prompt": "Hello", "max_tokens": 50, "stream": True}
                with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
                    events.extend(line for line in r.iter_lines() if line.startswith("data:"))
            reader = threading.Thread(target=stream)
            reader.start()
            assert wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 503, 30)
            start = time.monotonic()
            os.kill(proc.pid, signal.SIGTERM)
            assert wait_gone(pids, 30) is not None
            assert time.monotonic() - start < 20
            reader.join(30)
            assert "shutting down" in json.loads(events[-2][5:])["error"]["message"], events
            assert events[-1] == "data: [DONE]"
            assert proc.wait() == 143
            assert not rundirs(proc.pid)
        log.seek(0)
        text = log.read()
    assert not {s for s in our_shm_segments() if s.startswith(f"nvtp_{proc.pid}_")}
    assert "--shutdown-timeout" in text and "Traceback" not in text, text


@pytest.mark.slow
def test_bench_limits_runs_and_reports_every_figure(tiny_model_dir, capsys):
    from nanovllm_tp.bench import limits as bench_limits
    figures = bench_limits.main(["--model", tiny_model_dir, "--repeats", "1", "--batch", "40", "--body-mb", "20",
                                 *ENGINE_ARGS])
    assert len(figures) == 11 and all(v >= 0 for v in figures.values())
    assert any("[exit code 0]" in name for name in figures)
    assert capsys.readouterr().out.splitlines()[-1].lstrip().startswith("SIGTERM mid-stream -> exit")
