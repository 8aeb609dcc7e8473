"""Disaggregated prefill and decode against colocated replicas, one server at a time, interleaved: `serve -dp 2`
(both replicas mixed) and `serve -dp 2 --replica-roles prefill,decode`, each replica on --threads threads.

    nanovllm-tp bench disagg --model FILE.gguf --rates 0.05 0.1 0.2 --streams 8 --duration 60

The workload at each rate: --streams clients each stream one short-prompt completion of --stream-tokens after
another (the steady decode streams), while long prompts (--long-prompt LO HI tokens, uniform) arrive as a Poisson
process at the rate (requests per second), each streaming --long-tokens. Prompts are token ids drawn from the
vocabulary (seeded: the same workload for both layouts). Per point: the decode streams' TPOT (the seconds between a
stream's first and last chunk over its tokens after the first; p50, p99), the long prompts' TTFT (p50, p99), and
goodput: the requests per second that finished within both targets (TTFT <= --ttft-slo, TPOT <= --tpot-slo:
DistServe's measure), counting every request that finished in the window. Requests still running at the end of
--duration are waited for and counted.

`--transfer` instead measures the KV transfer itself, offline (engine/kv_transfer.py): a --transfer-tokens request
exported from one engine and imported into another, its KV as bytes in the payload and by reference (copied from
pool to pool, workers/kv_pool.py), against the fastest plain copy of as many bytes between buffers already in
memory (the same two each time: partly in the last-level cache) and against one between buffers that are not in
any cache (a ring of buffer pairs over COLD_RING_BYTES, each copy the next pair, as a request's KV is when it moves);
medians of --repeats, per KV dtype.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

from nanovllm_tp.bench.common import sse_events
from nanovllm_tp.config.engine_config import add_engine_args, engine_argv, engine_kwargs
from nanovllm_tp.launch import serve_process

LAYOUTS = {"colocated": [], "disaggregated": ["--replica-roles", "prefill,decode"]}
COLD_RING_BYTES = 512 << 20      # the cold copy's buffers: far beyond any last-level cache


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanovllm-tp bench disagg", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.1, 0.2], help="long prompts per second")
    g.add_argument("--streams", type=int, default=8, help="steady decode streams")
    g.add_argument("--stream-prompt", type=int, default=32, help="a decode stream's prompt tokens")
    g.add_argument("--stream-tokens", type=int, default=256, help="a decode stream's output tokens")
    g.add_argument("--long-prompt", type=int, nargs=2, default=[2000, 4000], metavar=("LO", "HI"))
    g.add_argument("--long-tokens", type=int, default=16, help="a long prompt's output tokens")
    g.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per point")
    g.add_argument("--ttft-slo", type=float, default=10.0, help="goodput's TTFT target, seconds")
    g.add_argument("--tpot-slo", type=float, nargs="+", default=[0.025, 0.1],
                   help="goodput's TPOT targets, seconds (a goodput column each)")
    g.add_argument("--threads", type=int, default=1, help="CPU threads per replica")
    g.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    g.add_argument("--workload-seed", type=int, default=0, help="seed of the prompts and arrivals")
    t = p.add_argument_group("--transfer: the KV transfer offline")
    t.add_argument("--transfer", action="store_true", help="measure export + import against a copy instead")
    t.add_argument("--transfer-tokens", type=int, default=1000)
    t.add_argument("--kv-dtypes", nargs="+", default=["auto", "int8"], help="kv_cache_dtype values to measure")
    t.add_argument("--repeats", type=int, default=5)
    from nanovllm_tp.bench.common import add_output_args
    add_output_args(p)
    return p


class Point:
    """One layout at one rate: the clients, and what each request saw."""

    def __init__(self, base: str, args, rate: float, vocab: int):
        self.base, self.args, self.rate, self.vocab = base, args, rate, vocab
        self.stop = threading.Event()
        self.records: list[dict] = []
        self.lock = threading.Lock()

    def _prompt(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(100, self.vocab) for _ in range(n)]

    def _one(self, kind: str, prompt: list[int], max_tokens: int) -> None:
        import httpx
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        sent = time.monotonic()
        first = last = None
        tokens, ok = 0, False
        try:
            with httpx.stream("POST", f"{self.base}/completions", json=body, timeout=600) as r:
                for event in sse_events(r.iter_lines()):
                    if event == "[DONE]":
                        ok = True
                        break
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    if any(ch.get("text") for ch in event.get("choices", [])):
                        last = time.monotonic()
                        first = first or last
        except Exception:
            ok = False
        with self.lock:
            self.records.append({"kind": kind, "sent": sent, "first": first, "last": last, "tokens": tokens,
                                 "ok": ok and first is not None})

    def _streams(self, i: int) -> None:
        rng = random.Random(self.args.workload_seed * 1000 + i)
        while not self.stop.is_set():
            self._one("stream", self._prompt(rng, self.args.stream_prompt), self.args.stream_tokens)

    def run(self) -> list[dict]:
        a = self.args
        rng = random.Random(a.seed)
        clients = [threading.Thread(target=self._streams, args=(i,)) for i in range(a.streams)]
        for c in clients:
            c.start()
        longs, start = [], time.monotonic()
        due = start + rng.expovariate(self.rate)
        while due < start + a.duration:
            time.sleep(max(0.0, due - time.monotonic()))
            t = threading.Thread(target=self._one, args=("long", self._prompt(rng, rng.randint(*a.long_prompt)),
                                                         a.long_tokens))
            t.start()
            longs.append(t)
            due += rng.expovariate(self.rate)
        time.sleep(max(0.0, start + a.duration - time.monotonic()))
        self.stop.set()
        for t in clients + longs:
            t.join()
        self.elapsed = time.monotonic() - start
        return self.records


def summarize(records: list[dict], args, elapsed: float) -> dict:
    """A point's figures from what each request saw (its TTFT and TPOT, seconds, kept in "records")."""
    from nanovllm_tp.bench.report import percentile
    rows = [{"kind": r["kind"], "ok": r["ok"], "tokens": r["tokens"],
             "ttft": r["first"] - r["sent"] if r["ok"] else None,
             "tpot": ((r["last"] - r["first"]) / (r["tokens"] - 1) if r["tokens"] > 1 else 0.0) if r["ok"] else None}
            for r in records]
    done = [r for r in rows if r["ok"]]
    tpots = [r["tpot"] for r in done if r["kind"] == "stream"]
    ttfts = [r["ttft"] for r in done if r["kind"] == "long"]
    goodput = {f"{slo * 1000:g}": sum(r["ttft"] <= args.ttft_slo and r["tpot"] <= slo for r in done) / elapsed
               for slo in args.tpot_slo}
    return {"requests": len(rows), "failed": len(rows) - len(done),
            "tpot_p50_ms": _ms(percentile(tpots, 50)), "tpot_p99_ms": _ms(percentile(tpots, 99)),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "long_done": len(ttfts), "goodput_rps": goodput, "records": rows}


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1000


def serve_point(args, layout: str, rate: float, vocab: int) -> dict:
    argv = [*engine_argv(args), "--served-model-name", "m", "--data-parallel-size", "2", "--threads",
            str(args.threads), *LAYOUTS[layout]]
    proc, base = serve_process.start(argv)
    try:
        point = Point(base, args, rate, vocab)
        records = point.run()
    finally:
        serve_process.stop(proc)
    return {"layout": layout, "rate": rate, **summarize(records, args, point.elapsed)}


def transfer(args) -> list[dict]:
    """Per KV dtype and way (`bytes`: the KV packed into the payload; `pool`: by reference, copied from pool to
    pool), the medians of export and import of one request's KV, against the fastest plain copy of as many bytes
    between two buffers already in memory (numpy's one thread, or torch's copy on the engine's threads)."""
    import numpy as np
    import torch

    from nanovllm_tp import LLM, SamplingParams
    from nanovllm_tp.engine.kv_transfer import export_request, import_request
    out = []
    for kv_dtype in args.kv_dtypes:
        knobs = {**engine_kwargs(args), "kv_cache_dtype": kv_dtype}
        first, second = LLM(**knobs), LLM(**knobs)
        try:
            rng = random.Random(args.workload_seed)
            vocab = first.config.model_config.vocab_size
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            for way in ("bytes", "pool"):
                exports, imports, size = [], [], 0
                for i in range(args.repeats + 1):    # a new prompt each time: no prefix cache hit on either side
                    rid = f"{way}{i}"
                    prompt = [rng.randrange(100, vocab) for _ in range(args.transfer_tokens)]
                    first.add_request(prompt, params, request_id=rid)
                    first.step()
                    first.step()
                    moved = first.stats()["kv_transfer"]["bytes_out"]
                    t0 = time.perf_counter()
                    payload = export_request(first, rid, by_reference=way == "pool")
                    t1 = time.perf_counter()
                    import_request(second, payload)
                    t2 = time.perf_counter()
                    second.abort_request([rid])
                    size = first.stats()["kv_transfer"]["bytes_out"] - moved
                    if i:                    # the first maps the other pool once
                        exports.append(t1 - t0)
                        imports.append(t2 - t1)
                if second.stats()["kv_transfer"]["completions_recomputed"]:
                    raise RuntimeError("an imported request computed again: the transfer was not measured")
                copies, cold = _copies(size, args.repeats)
                med = {k: statistics.median(v) for k, v in (("export", exports), ("import", imports),
                                                             ("copy", copies), ("cold_copy", cold))}
                out.append({"kv_dtype": first.stats()["kv_cache_dtype"], "way": way, "bytes": size,
                            "payload_bytes": len(payload), **{f"{k}_ms": v * 1000 for k, v in med.items()},
                            "transfer_gb_s": size / (med["export"] + med["import"]) / 1e9,
                            "copy_gb_s": size / med["copy"] / 1e9, "cold_copy_gb_s": size / med["cold_copy"] / 1e9})
        finally:
            first.close()
            second.close()
    return out


def _copies(size: int, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of `repeats` plain copies of `size` bytes by numpy (one thread) and by torch (the engine's threads):
    between the same two buffers each time (warm; each the faster of the two), and between the next of a ring of
    buffer pairs over COLD_RING_BYTES each time (cold: neither side in a cache; the faster of the two's runs)."""
    import numpy as np
    import torch

    def fastest(dst, src) -> float:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        t1 = time.perf_counter()
        torch.from_numpy(dst).copy_(torch.from_numpy(src))
        return min(t1 - t0, time.perf_counter() - t1)

    src, dst = np.random.default_rng(0).integers(0, 255, size, np.uint8), np.ones(size, np.uint8)
    warm = [fastest(dst, src) for _ in range(repeats)]
    pairs = max(4, COLD_RING_BYTES // (2 * size))
    ring_src, ring_dst = np.full(pairs * size, 7, np.uint8), np.ones(pairs * size, np.uint8)   # every page touched
    cold = {"numpy": [], "torch": []}
    for i in range(2 * repeats):    # one copy a pair (a second would find it warm), numpy's and torch's in turn
        at, way = (i % pairs) * size, "numpy" if i % 2 else "torch"
        dst, src = ring_dst[at:at + size], ring_src[at:at + size]
        t0 = time.perf_counter()
        np.copyto(dst, src) if way == "numpy" else torch.from_numpy(dst).copy_(torch.from_numpy(src))
        cold[way].append(time.perf_counter() - t0)
    return warm, min(cold.values(), key=statistics.median)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    from nanovllm_tp.bench import common as bc
    env = bc.environment()
    if args.transfer:
        rows = transfer(args)
        lines = ["| KV dtype | way | KV MB | payload MB | export ms | import ms | copy ms (warm / cold) | "
                 "transfer GB/s | copy GB/s (warm / cold) | share of a copy (warm / cold) |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            warm, cold = r["transfer_gb_s"] / r["copy_gb_s"], r["transfer_gb_s"] / r["cold_copy_gb_s"]
            lines.append(f"| {r['kv_dtype']} | {r['way']} | {r['bytes'] / 1e6:.1f} | {r['payload_bytes'] / 1e6:.3f} | "
                         f"{r['export_ms']:.2f} | {r['import_ms']:.2f} | {r['copy_ms']:.2f} / "
                         f"{r['cold_copy_ms']:.2f} | {r['transfer_gb_s']:.2f} | {r['copy_gb_s']:.2f} / "
                         f"{r['cold_copy_gb_s']:.2f} | {warm:.0%} / {cold:.0%} |")
        return bc.finish(args, "disagg-transfer", env, "\n".join(lines), rows=rows)
    vocab = bc.model_vocab_size(args.model)
    points = []
    for i, rate in enumerate(args.rates):
        order = args.layouts if i % 2 == 0 else list(reversed(args.layouts))
        for layout in order:
            point = serve_point(args, layout, rate, vocab)
            print(json.dumps({k: v for k, v in point.items() if k != "records"}), flush=True)
            points.append(point)
    slos = [f"{slo * 1000:g}" for slo in args.tpot_slo]
    lines = ["| rate (long/s) | layout | decode TPOT p50 / p99 ms | long TTFT p50 / p99 s | "
             + " | ".join(f"goodput req/s (TTFT <= {args.ttft_slo:g} s, TPOT <= {slo} ms)" for slo in slos)
             + " | requests (failed) |", "|---|---|---|---|" + "---|" * len(slos) + "---|"]
    for p in sorted(points, key=lambda p: (p["rate"], p["layout"])):
        goodput = " | ".join(f"{p['goodput_rps'][slo]:.3f}" for slo in slos)
        lines.append(f"| {p['rate']:g} | {p['layout']} | {_f(p['tpot_p50_ms'])} / {_f(p['tpot_p99_ms'])} | "
                     f"{_f(p['ttft_p50_s'], 2)} / {_f(p['ttft_p99_s'], 2)} | {goodput} | "
                     f"{p['requests']} ({p['failed']}) |")
    return bc.finish(args, "disagg", env, "\n".join(lines), points=points)


def _f(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


if __name__ == "__main__":
    main()
