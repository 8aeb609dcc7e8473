"""A rolling restart under load, by migration against by re-prefill: `serve -dp 2` (the engine flags given here,
--threads per replica), --streams clients each streaming one completion of a --prompt-tokens prompt (token ids,
seeded, one per stream: no prefix shared) and --max-tokens tokens; once every stream has --before tokens, SIGHUP
restarts replica 0 and then replica 1, each one's open streams moving to the other
(`--migrate-kv-on-restart`, the default: with their KV; `--no-migrate-kv-on-restart`: computed again there).
Modes, one server each, interleaved over --repeats:

    migrate     SIGHUP, streams move with their KV
    reprefill   SIGHUP, streams computed again where they move
    none        no SIGHUP: the same load undisturbed

    nanovllm-tp bench restart --model SmolLM2.Q4_1.gguf --streams 16 --prompt-tokens 1000 --max-tokens 200

Per mode: requests failed (an error event, a non-200, no [DONE]); per stream, the longest gap between two of its
chunks (the stall a move caused) and its time from first to last token; the added latency is the median of the
latter against `none`'s. The server's counters say how many streams moved with their KV (router_requests_migrated),
how many were resumed in all (router_requests_resumed), and the bytes of the migrated payloads that crossed the
HTTP process (router_kv_migrated_bytes: each request's state, the KV itself copied from pool to pool on one host).
"""
from __future__ import annotations

import argparse
import random
import signal
import statistics
import threading
import time

from nanovllm_tp.bench.chaos import counter, wait_all_up
from nanovllm_tp.bench.common import sse_events
from nanovllm_tp.config.engine_config import add_engine_args, engine_argv
from nanovllm_tp.launch import serve_process
from nanovllm_tp.launch.serve_process import title, tree

MODES = {"migrate": [], "reprefill": ["--no-migrate-kv-on-restart"], "none": []}


class Stream(threading.Thread):
    """One streamed completion; each chunk's arrival time."""

    def __init__(self, base: str, prompt: list[int], max_tokens: int):
        super().__init__(daemon=True)
        self.base, self.prompt, self.max_tokens = base, prompt, max_tokens
        self.times: list[float] = []
        self.tokens = 0
        self.why: str | None = None

    def run(self) -> None:
        import httpx
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        done = False
        try:
            with httpx.stream("POST", f"{self.base}/completions", json=body, timeout=900) as r:
                if r.status_code != 200:
                    self.why = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                for event in sse_events(r.iter_lines()) if self.why is None else ():
                    if event == "[DONE]":
                        done = True
                    elif "error" in event:
                        self.why = f"error event: {event['error'].get('message')}"
                    elif event["choices"]:
                        self.times.append(time.monotonic())
                        self.tokens += 1
        except Exception as exc:               # a connection reset, a timeout
            self.why = f"{type(exc).__name__}: {exc}"
        if self.why is None and not done:
            self.why = "the stream ended without [DONE]"


def replica_pids(root: int) -> dict[int, int]:
    """Each replica's rank-0 process: dp rank -> pid."""
    out = {}
    for pid in tree(root):
        name = title(pid)
        if name.startswith("nanovllm_tp::dp") and name.endswith("::tp0"):
            out[int(name.removeprefix("nanovllm_tp::dp").split("::")[0])] = pid
    return out


def point(args, mode: str, prompts: list[list[int]]) -> dict:
    argv = engine_argv(args) + ["--data-parallel-size", "2", "--threads", str(args.threads), *MODES[mode]]
    proc, base = serve_process.start(argv)
    try:
        if not wait_all_up(base, 2, 300):
            raise SystemExit("bench restart: the replicas did not both come up")
        old = replica_pids(proc.pid)
        streams = [Stream(base, p, args.max_tokens) for p in prompts]
        for s in streams:
            s.start()
        deadline = time.monotonic() + 600
        while any(s.tokens < args.before and s.is_alive() for s in streams) and time.monotonic() < deadline:
            time.sleep(0.05)
        hup = time.monotonic()
        if mode != "none":
            proc.send_signal(signal.SIGHUP)
        for s in streams:
            s.join(900)
        restarted = None
        if mode != "none":
            while time.monotonic() < deadline:
                now = replica_pids(proc.pid)
                if len(now) == 2 and all(now[i] != old[i] for i in (0, 1)) and wait_all_up(base, 2, 5):
                    restarted = time.monotonic() - hup
                    break
                time.sleep(0.2)
        migrated, resumed = counter(base, "router_requests_migrated"), counter(base, "router_requests_resumed")
        through_http = counter(base, "router_kv_migrated_bytes")     # payloads: state, and KV sent as bytes
    finally:
        serve_process.stop(proc)
    gaps = [max(b - a for a, b in zip(s.times, s.times[1:])) for s in streams if len(s.times) > 1]
    spans = [s.times[-1] - s.times[0] for s in streams if len(s.times) > 1]
    return {"mode": mode, "failed": [s.why for s in streams if s.why], "streams": len(streams),
            "max_gap_p50_s": statistics.median(gaps), "max_gap_max_s": max(gaps),
            "span_p50_s": statistics.median(spans), "migrated": migrated, "resumed": resumed,
            "migrated_payload_bytes": through_http,
            "restart_s": restarted}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanovllm-tp bench restart", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--before", type=int, default=20, help="tokens every stream has before the SIGHUP")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per replica")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--workload-seed", type=int, default=0)
    from nanovllm_tp.bench.common import add_output_args
    add_output_args(p)
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    from nanovllm_tp.bench import common as bc
    if args.model is None:
        from nanovllm_tp.launch.make_tiny import ensure_tiny
        args.model = str(ensure_tiny())
    env = bc.environment()
    vocab = bc.model_vocab_size(args.model)
    rng = random.Random(args.workload_seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.streams)]
    points = []
    for r in range(args.repeats):
        for mode in args.modes if r % 2 == 0 else list(reversed(args.modes)):
            points.append(point(args, mode, prompts))
            print({k: v for k, v in points[-1].items() if k != "failed"}, flush=True)
    base = [p["span_p50_s"] for p in points if p["mode"] == "none"]
    lines = ["| mode | failed | longest gap per stream, p50 / max s | stream span p50 s | added latency s | "
             "streams migrated / resumed | both replicas back after s |", "|---|---|---|---|---|---|---|"]
    for p in points:
        added = f"{p['span_p50_s'] - statistics.median(base):.2f}" if base else "-"
        back = "-" if p["restart_s"] is None else f"{p['restart_s']:.1f}"
        lines.append(f"| {p['mode']} | {len(p['failed'])} | {p['max_gap_p50_s']:.2f} / {p['max_gap_max_s']:.2f} | "
                     f"{p['span_p50_s']:.2f} | {added} | {p['migrated']:.0f} / {p['resumed']:.0f} | {back} |")
    return bc.finish(args, "restart", env, "\n".join(lines), points=points)


if __name__ == "__main__":
    main()
