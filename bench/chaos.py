"""Ranks killed under load: does a data-parallel server heal? `serve --data-parallel-size D` on a free 127.0.0.1
port (the engine flags given here), --streams clients each streaming one greedy completion after another, and every
--kill-every LO HI seconds (uniform, seeded) kill -9 of a random rank of a random replica, once every replica is
up; after --duration seconds the kills stop, the streams finish the request they are on, and the server gets
SIGTERM.

    nanovllm-tp bench chaos --data-parallel-size 2 --batch-invariant                    # the tiny model
    nanovllm-tp bench chaos --data-parallel-size 2 --tensor-parallel-size 2 --batch-invariant --duration 120

What it counts: requests completed and failed (an error event, a 5xx, no [DONE]); with --batch-invariant, the
answers that differ from the same engine's offline answer (an undisturbed run: each prompt's greedy text, computed
in this process before the server starts); deaths, and the seconds until /metrics shows the replica down
(replica_up 0) and /health says degraded; streams the server resumed or ran again elsewhere; the latency a death
added (the median time of requests that were running at a kill, against those that were not); SIGTERM's exit code
and seconds to exit; and what was left behind (a process of the server's tree, a /dev/shm segment or run directory
named after one of its pids).
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import signal
import statistics
import threading
import time

from nanovllm_tp.bench.common import sse_events
from nanovllm_tp.config.engine_config import add_engine_args, engine_argv
from nanovllm_tp.distributed.channel_common import proc_start_time
from nanovllm_tp.launch import serve_process
from nanovllm_tp.launch.serve_process import title, tree

PROMPTS = ["Once upon a time there", "The quick brown fox", "Hello, my name is", "In the beginning",
           "A long time ago in a land", "The capital of France is", "Tell me a story about", "My favourite food is"]
_UP = re.compile(r'nanovllm_tp:replica_up\{dp_rank="(\d+)",model_name="[^"]*"\} (\S+)')


def replicas_up(base: str) -> dict[int, bool]:
    import httpx
    text = httpx.get(f"{base.removesuffix('/v1')}/metrics", timeout=30).text
    return {int(r): float(v) == 1.0 for r, v in _UP.findall(text)}


def counter(base: str, name: str) -> float:
    import httpx
    text = httpx.get(f"{base.removesuffix('/v1')}/metrics", timeout=30).text
    found = re.search(rf"nanovllm_tp:{name}_total\{{[^}}]*\}} (\S+)", text)
    return float(found.group(1)) if found else 0.0


class Streams:
    """--streams clients, each streaming one completion after another until told to stop."""

    def __init__(self, base: str, count: int, max_tokens: int, expected: dict[str, str] | None):
        self.base, self.max_tokens, self.expected = base, max_tokens, expected
        self.stop = threading.Event()
        self.results: list[dict] = []       # per request: prompt, start, end, ok, why, equal
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(count)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.1, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _client(self, i: int) -> None:
        k = i
        while not self.stop.is_set():
            prompt = PROMPTS[k % len(PROMPTS)]
            k += len(self._threads)
            result = self._one(prompt)
            with self._lock:
                self.results.append(result)

    def _one(self, prompt: str) -> dict:
        import httpx
        body = {"prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        start, text, done, why = time.monotonic(), "", False, None
        try:
            with httpx.stream("POST", f"{self.base}/completions", json=body, timeout=600) as r:
                if r.status_code != 200:
                    why = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                for event in sse_events(r.iter_lines()) if why is None else ():
                    if event == "[DONE]":
                        done = True
                        continue
                    if "error" in event:
                        why = f"error event: {event['error'].get('message')}"
                        continue
                    text += "".join(c["text"] for c in event["choices"])
        except Exception as exc:               # a connection reset, a timeout
            why = f"{type(exc).__name__}: {exc}"
        if why is None and not done:
            why = "the stream ended without [DONE]"
        equal = None if self.expected is None or why is not None else text == self.expected[prompt]
        return {"prompt": prompt, "start": start, "end": time.monotonic(), "ok": why is None, "why": why,
                "equal": equal}


def expected_texts(args, max_tokens: int) -> dict[str, str]:
    """Each prompt's greedy answer from the same engine, offline and undisturbed."""
    from nanovllm_tp import SamplingParams
    from nanovllm_tp.launch.generate import build_llm
    llm = build_llm(args)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.close()
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


def wait_all_up(base: str, size: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        up = replicas_up(base)
        if len(up) == size and all(up.values()):
            return True
        time.sleep(0.2)
    return False


def kill_one(base: str, root: int, rng: random.Random, size: int, tp: int) -> dict:
    """kill -9 of a random rank of a random replica; the seconds until replica_up says 0 and /health degraded."""
    import httpx
    replica, rank = rng.randrange(size), rng.randrange(tp)
    want = f"nanovllm_tp::dp{replica}::tp{rank}"
    victim = next((p for p in tree(root) if title(p) == want), None)
    if victim is None:
        return {"replica": replica, "rank": rank, "killed": None}
    os.kill(victim, signal.SIGKILL)
    at = time.monotonic()
    seen = health = None
    while time.monotonic() - at < 30 and (seen is None or health is None):
        now = time.monotonic() - at
        if seen is None and not replicas_up(base).get(replica, True):
            seen = now
        if health is None:
            r = httpx.get(f"{base.removesuffix('/v1')}/health", timeout=30)
            if r.status_code == 503 or (r.content and r.json().get("status") == "degraded"):
                health = now
        time.sleep(0.05)
    return {"replica": replica, "rank": rank, "killed": victim, "at": at, "seen_s": seen, "health_s": health}


def leftovers(pids: set[int]) -> list[str]:
    """What the server's processes left: a live process, a /dev/shm segment or run directory named after one."""
    found = [f"process {p} ({title(p)})" for p in sorted(pids) if proc_start_time(p) is not None]
    for directory, pattern in (("/dev/shm", r"nvtp_(\d+)_"), ("/tmp", r"nanovllm_tp-serve-(\d+)-")):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        found += [os.path.join(directory, n) for n in names if (m := re.match(pattern, n)) and int(m.group(1)) in pids]
    return found


def run(args) -> dict:
    size, tp = args.data_parallel_size, args.tensor_parallel_size
    if size < 2:
        raise SystemExit("bench chaos: --data-parallel-size must be at least 2 (a replica must survive)")
    expected = expected_texts(args, args.max_tokens) if args.batch_invariant else None
    argv = engine_argv(args) + ["--data-parallel-size", str(size)] + shlex.split(args.server_args)
    proc, base = serve_process.start(argv)
    rng = random.Random(args.kill_seed)
    seen_pids: set[int] = set(tree(proc.pid))
    kills: list[dict] = []
    try:
        if not wait_all_up(base, size, 300):
            raise SystemExit("bench chaos: the replicas did not all come up")
        streams = Streams(base, args.streams, args.max_tokens, expected)
        streams.start()
        end = time.monotonic() + args.duration
        while time.monotonic() < end:
            time.sleep(min(rng.uniform(*args.kill_every), max(0.0, end - time.monotonic())))
            if time.monotonic() >= end:
                break
            seen_pids.update(tree(proc.pid))
            if wait_all_up(base, size, 120):
                kills.append(kill_one(base, proc.pid, rng, size, tp))
            seen_pids.update(tree(proc.pid))
        streams.stop.set()
        finished = streams.join(300)
        resumed, rerun = counter(base, "router_requests_resumed"), counter(base, "router_requests_resubmitted")
        seen_pids.update(tree(proc.pid))
        stop_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        exit_s = time.monotonic() - stop_at
    finally:
        serve_process.stop(proc)
    deadline = time.monotonic() + 15
    while leftovers(seen_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    results = streams.results
    deaths = [k["at"] for k in kills if k.get("killed")]
    hit = [r for r in results if any(r["start"] <= at <= r["end"] for at in deaths)]
    calm = [r for r in results if r not in hit]
    duration = lambda rs: statistics.median([r["end"] - r["start"] for r in rs]) if rs else None  # noqa: E731
    return {"requests": len(results), "failed": [r["why"] for r in results if not r["ok"]],
            "unequal": sum(r["equal"] is False for r in results), "compared": sum(r["equal"] is not None
                                                                                 for r in results),
            "deaths": sum(1 for k in kills if k.get("killed")), "kills": kills,
            "seen_s": [k.get("seen_s") for k in kills if k.get("killed")],
            "health_s": [k.get("health_s") for k in kills if k.get("killed")],
            "resumed": resumed, "run_again": rerun, "streams_finished": finished,
            "median_s_running_at_a_death": duration(hit), "median_s_otherwise": duration(calm),
            "exit_code": code, "exit_s": exit_s, "left_behind": leftovers(seen_pids)}


def report(result: dict) -> str:
    def fmt(xs):
        xs = [x for x in xs if x is not None]
        return f"median {statistics.median(xs):.2f} s, max {max(xs):.2f} s" if xs else "-"
    lines = [f"requests {result['requests']}, failed {len(result['failed'])}, answers compared "
             f"{result['compared']}, unequal {result['unequal']}",
             f"deaths {result['deaths']}: replica_up 0 after {fmt(result['seen_s'])}; /health degraded after "
             f"{fmt(result['health_s'])}",
             f"streams resumed {result['resumed']:.0f}, requests run again {result['run_again']:.0f}",
             f"request time, median: running at a death {result['median_s_running_at_a_death']}, otherwise "
             f"{result['median_s_otherwise']}",
             f"SIGTERM: exit code {result['exit_code']} after {result['exit_s']:.1f} s; left behind: "
             f"{result['left_behind'] or 'nothing'}"]
    lines += [f"  failed: {why}" for why in result["failed"][:10]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of kills")
    parser.add_argument("--kill-every", type=float, nargs=2, default=[10.0, 20.0], metavar=("LO", "HI"))
    parser.add_argument("--kill-seed", type=int, default=0, help="seeds the choice of victims and intervals")
    parser.add_argument("--server-args", default="", help="more launch/serve flags")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.model is None:
        from nanovllm_tp.launch.make_tiny import ensure_tiny
        args.model = str(ensure_tiny())
    result = run(args)
    print(f"bench_chaos: {os.path.basename(args.model)}, -dp {args.data_parallel_size} --tp "
          f"{args.tensor_parallel_size}, {args.streams} streams, {args.duration:.0f} s of kills every "
          f"{args.kill_every[0]:g}-{args.kill_every[1]:g} s")
    print(report(result))
    return result


if __name__ == "__main__":
    main()
