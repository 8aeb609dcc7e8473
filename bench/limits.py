"""What a hostile client costs our server (launch/serve on a free 127.0.0.1 port, the engine flags given here),
and how fast the server gets rid of it:

    python -m nanovllm_tp.bench.limits --model SmolLM2-135M-Instruct.Q4_1.gguf --max-model-len 1024
    python -m nanovllm_tp.bench.limits --repeats 5 --server-args "--http-priority idle"

- 413, Content-Length: a 50 MiB body announced in its headers; seconds from the first byte sent to the 413.
- 413, chunked: the same body without a length, sent as fast as the socket takes it (refused once past
  --max-request-body-bytes).
- small request: a 4-token completion, idle, then while a chunked 50 MiB upload is paced at 1 MiB per 0.1 s, then
  while a 10 MiB text prompt (within the body limit, far beyond the context) is refused.
- tokenize flood: four clients at once send /tokenize a prompt of 8.4 million characters ("hello world " x
  700,000, far beyond any context); a small request's latency meanwhile, the seconds until the last of the four is
  answered, and the HTTP process's resident memory afterwards, over what it was before (MiB).
- abandoned batch: --batch prompts in one completions request whose client hangs up once /metrics shows them in
  the engine; seconds from the hang-up until /metrics shows no running and no waiting request.
- SIGTERM: a fresh server per repeat streams one long completion; seconds from SIGTERM to the error event, and
  to the command's exit (its exit code is printed).

Each figure is the median over --repeats (min and max beside it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import select
import shlex
import signal
import socket
import statistics
import threading
import time

from nanovllm_tp.config.engine_config import add_engine_args, engine_argv
from nanovllm_tp.launch import serve_process

MB = 1 << 20


def raw_post(port: int, total: int, chunked: bool, on_progress=None, pace_s: float = 0.0) -> tuple[int, int]:
    """POST /v1/completions with a body of `total` bytes, 1 MiB at a time (pace_s apart) until the server answers:
    (the status it answered, the bytes sent by then)."""
    head = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"{head}\r\n\r\n".encode())
        sent, piece = 0, b"x" * MB
        while sent < total and not select.select([s], [], [], pace_s or 0.001)[0]:
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            except OSError:                  # the server answered and closed while we were writing
                break
            sent += len(piece)
            if on_progress is not None:
                on_progress(sent)
        answer = s.recv(4096).decode(errors="replace")
    return int(answer.split()[1]), sent


def metrics(port: int) -> dict[str, float]:
    import httpx
    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text.splitlines():
        m = re.match(r'^nanovllm_tp:(\w+)(\{[^}]*\})? ([0-9.eE+-]+)$', line)
        if m:
            out[m.group(1)] = float(m.group(3))
    return out


def small_request(port: int) -> float:
    import httpx
    start = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300,
                   json={"prompt": "The capital of France is", "max_tokens": 4})
    r.raise_for_status()
    return time.perf_counter() - start


def during(port: int, background) -> float:
    """A small request's latency while `background(started)` runs in a thread (sent once it calls started())."""
    ready = threading.Event()
    t = threading.Thread(target=background, args=(ready.set,))
    t.start()
    ready.wait(120)
    took = small_request(port)
    t.join()
    return took


def abandoned_batch(port: int, batch: int, max_tokens: int = 200, timeout: float = 300.0) -> float:
    """Send one completions request of `batch` prompts, wait until the engine holds them (/metrics), hang up:
    the seconds from the hang-up until no request is running or waiting."""
    body = json.dumps({"prompt": [f"Request {i}: tell me a story about" for i in range(batch)],
                       "max_tokens": max_tokens, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + timeout
        while not _in_flight(port):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {batch}-prompt batch never reached the engine")
            time.sleep(0.05)
    start = time.perf_counter()                         # the connection is closed: the client went away
    while _in_flight(port):
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"requests still in the engine {timeout:.0f} s after the client left")
        time.sleep(0.05)
    return time.perf_counter() - start


def _in_flight(port: int) -> float:
    m = metrics(port)
    return m["num_requests_running"] + m["num_requests_waiting"]


def sigterm(argv: list[str], max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the stream's error event, seconds to exit, exit code) after SIGTERM mid-stream."""
    import httpx
    proc, base = serve_process.start(argv)
    try:
        body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/completions", json=body, timeout=120) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data:"))
            next(lines)
            start = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            last = [line for line in lines if line != "data: [DONE]"][-1:]     # the error event, before [DONE]
            to_error = time.perf_counter() - start
        code = proc.wait(120)
        to_exit = time.perf_counter() - start
        if not last or "error" not in last[0]:
            raise SystemExit(f"the stream did not end with an error event: {last}")
        return to_error, to_exit, code
    finally:
        serve_process.stop(proc)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--server-args", default="--http-priority normal",
                        help="more launch/serve flags (default keeps HTTP at normal priority: on a shared "
                             "machine, idle priority leaves it starved by others' work)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1500)
    parser.add_argument("--body-mb", type=int, default=50)
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.model is None:
        from nanovllm_tp.launch.make_tiny import ensure_tiny
        args.model = str(ensure_tiny())
    server_argv = engine_argv(args) + shlex.split(args.server_args)
    total = args.body_mb * MB
    runs: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        runs.setdefault(name, []).append(value)

    proc, base = serve_process.start(server_argv)
    port = int(base.rsplit(":", 1)[1].split("/")[0])
    try:
        small_request(port)                                                 # warm-up
        for _ in range(args.repeats):
            start = time.perf_counter()
            status, _ = raw_post(port, total, chunked=False)
            record("413 with Content-Length (s)", time.perf_counter() - start) if status == 413 else None
            start = time.perf_counter()
            status, _ = raw_post(port, total, chunked=True)
            record("413 chunked (s)", time.perf_counter() - start) if status == 413 else None
            record("small request, idle (s)", small_request(port))
            record("small request, during a paced 50 MiB upload (s)", during(port, lambda started: raw_post(
                port, total, True, lambda n: n >= 2 * MB and started(), pace_s=0.1)))
            record("small request, during a 10 MiB prompt (s)", during(port, lambda started: _big_prompt(port,
                                                                                                       started)))
            rss = http_rss_mib(proc.pid)
            flood: list[float] = []
            record("small request, during four 8.4 MB /tokenize prompts (s)",
                   during(port, lambda started: flood.append(tokenize_flood(port, started))))
            record("four 8.4 MB /tokenize prompts, all answered (s)", flood[0])
            time.sleep(1.0)
            record("HTTP process memory after them, over before (MiB)", max(0.0, http_rss_mib(proc.pid) - rss))
            record(f"gauges at 0 after an abandoned {args.batch}-prompt batch (s)", abandoned_batch(port, args.batch))
    finally:
        serve_process.stop(proc)
    max_model_len = args.max_model_len or 1024
    for _ in range(args.repeats):
        to_error, to_exit, code = sigterm(server_argv, max_model_len // 2)
        record("SIGTERM mid-stream -> error event (s)", to_error)
        record(f"SIGTERM mid-stream -> exit (s) [exit code {code}]", to_exit)
    print(f"bench_limits: {os.path.basename(args.model)}, {args.repeats} repeats, server flags: "
          f"{' '.join(server_argv)}")
    for name, values in runs.items():
        print(f"  {name:<66} median {statistics.median(values):8.3f}   min {min(values):8.3f}   "
              f"max {max(values):8.3f}")
    return {name: statistics.median(values) for name, values in runs.items()}


def tokenize_flood(port: int, started, clients: int = 4) -> float:
    """`clients` concurrent /tokenize requests of 8.4 million characters each; started() once they are sent.
    The seconds until the last is answered."""
    import httpx
    body = json.dumps({"prompt": "hello world " * 700_000}).encode()
    start = time.perf_counter()

    def one():
        httpx.post(f"http://127.0.0.1:{port}/tokenize", content=body, timeout=600,
                   headers={"Content-Type": "application/json"})
    threads = [threading.Thread(target=one) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    started()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def http_rss_mib(server_pid: int) -> float:
    """The resident memory of the server's HTTP process (the descendant titled nanovllm_tp::http, or running
    nanovllm_tp.serving.frontend where setproctitle is missing), MiB."""
    for pid in serve_process.tree(server_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if cmdline.startswith(b"nanovllm_tp::http") or b"nanovllm_tp.serving.frontend" in cmdline:
                with open(f"/proc/{pid}/status") as s:
                    return next(int(line.split()[1]) for line in s if line.startswith("VmRSS:")) / 1024
        except OSError:
            continue
    raise RuntimeError("the server has no HTTP process")


def _big_prompt(port: int, started) -> None:
    import httpx
    body = {"prompt": "word " * (2 * MB), "max_tokens": 4}
    with httpx.Client(timeout=300) as http:
        request = http.build_request("POST", f"http://127.0.0.1:{port}/v1/completions", json=body)
        started()
        http.send(request)


if __name__ == "__main__":
    main()
