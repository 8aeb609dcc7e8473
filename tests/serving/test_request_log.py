"""The request log of a real server (serving/request_log.py): a line when a request is accepted and one when it
ends, for a completion, a streamed chat, a refused request and a client that goes away; none with
--disable-log-requests; the prompt's first N characters with --max-log-len N and none without; uvicorn's access
lines, one per request. The line's arithmetic on given outputs is checked without a server."""
import logging
import re
import time

import httpx
import pytest

from nanovllm_tp.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanovllm_tp.serving.request_log import RequestLog, first_words
from tests.serving.test_serve import start_server, wait_ready

PROMPT = "The quick brown fox jumps over the lazy dog"
RECEIVED = re.compile(r"INFO nanovllm_tp: Received request (\S+): (.*)$")
FINISHED = re.compile(r"INFO nanovllm_tp: Finished request (\S+): (.*)$")
REFUSED = re.compile(r"INFO nanovllm_tp: Refused request (\S+) (\S+): (.*)$")
ACCESS = re.compile(r'INFO: +127\.0\.0\.1:\d+ - "(\S+) (\S+) HTTP/1\.1" (\d+)')


def fields(text: str) -> dict:
    """key=value parts of a line (a part without '=' maps to True)."""
    out = {}
    for part in text.split(", "):
        key, eq, value = part.partition("=")
        out[key] = value if eq else True
    return out


def lines(log, pattern: re.Pattern) -> list[tuple]:
    return [m.groups() for m in map(pattern.search, log.read_text().splitlines()) if m]


def wait_for(log, pattern: re.Pattern, request_id: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for rid, text in lines(log, pattern):
            if rid == request_id:
                return fields(text)
        time.sleep(0.2)
    pytest.fail(f"no {pattern.pattern!r} line for {request_id}:\n" + log.read_text()[-3000:])


def post(port: int, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}{path}", json={"model": "tiny", **body}, timeout=300)


@pytest.mark.spawn
def test_each_request_logs_its_start_and_end(tiny_model_dir, tmp_path):
    log = tmp_path / "stderr"
    port, ctx = start_server(tiny_model_dir, "--http-priority", "normal", stderr=open(log, "w"))
    with ctx as proc:
        wait_ready(port, proc)
        # a completion, whole
        r = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 7, "temperature": 0,
                                           "ignore_eos": True})
        assert r.status_code == 200, r.text
        done, rid = r.json(), r.json()["id"]
        got = wait_for(log, RECEIVED, rid)
        assert got == {"route": "/v1/completions", "prompt_tokens": str(done["usage"]["prompt_tokens"]),
                       "max_tokens": "7", "n": "1", "stream": "False"}, got
        end = wait_for(log, FINISHED, rid)
        assert end["finish_reason"] == "length" and end["generation_tokens"] == "7", end
        assert end["prompt_tokens"] == str(done["usage"]["prompt_tokens"])
        assert float(end["seconds"]) > 0 and 0 < float(end["ttft"]) <= float(end["seconds"]), end

        # a chat, streamed, n=2
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "n": 2,
                                "max_tokens": 5, "stream": True, "ignore_eos": True}) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: {")]
        rid = re.search(r'"id":\s*"([^"]+)"', events[0]).group(1)
        got = wait_for(log, RECEIVED, rid)
        assert got["route"] == "/v1/chat/completions" and got["stream"] == "True" and got["n"] == "2", got
        assert "prompt" not in got, got                 # no prompt text by default
        end = wait_for(log, FINISHED, rid)
        assert end["finish_reason"] == "length" and end["generation_tokens"] == "10", end

        # refused: a 400, one line with its status and the message's first words, no Received line
        r = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": -1})
        assert r.status_code == 400
        deadline = time.monotonic() + 30
        while not lines(log, REFUSED) and time.monotonic() < deadline:
            time.sleep(0.2)
        [(method, path, text)] = lines(log, REFUSED)
        assert (method, path) == ("POST", "/v1/completions"), text
        status, reason = fields(text)["status"], fields(text)["reason"]
        assert status == "400" and reason.strip("'").split()[0] in r.json()["error"]["message"], text
        assert len(reason) <= 110, reason

        # a client that goes away mid-stream: its request ends as such, with the tokens made until then
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=300,
                          json={"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
                                "stream": True}) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: {"))
        rid = re.search(r'"id":\s*"([^"]+)"', first).group(1)
        end = wait_for(log, FINISHED, rid)
        assert end.get("client disconnected") is True and end["finish_reason"] == "abort", end
        assert 1 <= int(end["generation_tokens"]) < 400, end
        received = [rid for rid, _ in lines(log, RECEIVED)]
        finished = [rid for rid, _ in lines(log, FINISHED)]
        assert len(received) == len(set(received)) == 3 and sorted(finished) == sorted(received), log.read_text()

        # uvicorn's access log: one line per request, on stderr
        access = lines(log, ACCESS)
        assert ("POST", "/v1/completions", "400") in access and ("POST", "/v1/chat/completions", "200") in access
        assert sum(a[:2] == ("POST", "/v1/chat/completions") for a in access) == 1, access


@pytest.mark.spawn
def test_the_flags_silence_the_log_or_add_the_prompt(tiny_model_dir, tmp_path):
    """--disable-log-requests (and --disable-uvicorn-access-log): no request line at all; --max-log-len 5: the
    prompt's first 5 characters, and no more."""
    quiet, short = tmp_path / "quiet", tmp_path / "short"
    port, ctx = start_server(tiny_model_dir, "--http-priority", "normal", "--disable-log-requests",
                             "--disable-uvicorn-access-log", stderr=open(quiet, "w"))
    with ctx as proc:
        wait_ready(port, proc)
        assert post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3}).status_code == 200
        assert post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": -3}).status_code == 400
        time.sleep(1)
    text = quiet.read_text()
    assert not RECEIVED.search(text) and "Finished request" not in text and "Refused request" not in text, text
    assert not ACCESS.search(text), text[-3000:]

    port, ctx = start_server(tiny_model_dir, "--http-priority", "normal", "--max-log-len", "5",
                             stderr=open(short, "w"))
    with ctx as proc:
        wait_ready(port, proc)
        r = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 200
        got = wait_for(short, RECEIVED, r.json()["id"])
    assert got["prompt"] == repr(PROMPT[:5]), got
    assert PROMPT[:6] not in short.read_text()


def output(rid: str, prompt: int, reasons: list, made: int, ttft: float | None) -> RequestOutput:
    metrics = RequestMetrics(10.0, None if ttft is None else 10.0 + ttft, None, 11.0, made)
    return RequestOutput(rid, None, [1] * prompt, None,
                         [CompletionOutput(i, "", [], finish_reason=r) for i, r in enumerate(reasons)], True, metrics)


def test_the_end_line_sums_the_prompts_and_choices(caplog):
    requests = RequestLog()
    with caplog.at_level(logging.INFO, logger="nanovllm_tp"):
        requests.accepted("cmpl-7", "/v1/completions", [[1, 2, 3], [4, 5]], object(), texts=["abc", "de"])
        requests.finished(output("cmpl-7-1", 2, ["stop", "length"], 9, 0.25))
        assert len(caplog.records) == 1            # one of two prompts: not ended yet
        requests.finished(output("cmpl-7-0", 3, ["stop", "stop"], 4, 0.5))
        requests.finished(output("cmpl-8-0", 3, ["stop"], 4, 0.5))           # not logged: never accepted here
    start, end = (r.getMessage() for r in caplog.records)
    assert start == "Received request cmpl-7: route=/v1/completions, prompt_tokens=5, prompts=2"
    assert re.fullmatch(r"Finished request cmpl-7: finish_reason=stop:3,length:1, prompt_tokens=5, "
                        r"generation_tokens=13, seconds=\d+\.\d{3}, ttft=0\.250", end), end
    assert requests.open == {}


def test_a_refusal_keeps_the_first_words_only():
    assert first_words("max_tokens must be at least 1") == "max_tokens must be at least 1"
    long = "word " * 40
    assert first_words(long) == " ".join(["word"] * 12) + " ..."
    assert len(first_words("x" * 500)) == 104
