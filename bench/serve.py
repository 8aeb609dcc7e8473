"""Serving benchmark against any OpenAI-compatible server (completions API, streamed, usage in the last chunk).

    python -m nanovllm_tp.bench.serve --base-url http://127.0.0.1:8000/v1 --concurrency 64
    python -m nanovllm_tp.bench.serve --base-url URL --api-key K --model NAME --request-rate 1 4 inf
    python -m nanovllm_tp.bench.serve --launch --compare-offline --concurrency 64 --repeats 3
    python -m nanovllm_tp.bench.serve --launch --compare-offline --request-rate 1 --repeats 3
    python -m nanovllm_tp.bench.serve --launch --compare-offline --api chat --dataset text --concurrency 1 \
        --num-requests 16 --output-len 128 128 --repeats 3          # one user chatting: TPOT against offline
    python -m nanovllm_tp.bench.serve --launch --data-parallel-size 2 --router prefix-aware round-robin \
        --dataset shared-prefix --num-prefixes 8 --prefix-len 600 --num-requests 128 --concurrency 16

Workload as in the other bench scripts (random prompt ids sent as token-id lists, or `--dataset text`: word
windows sampled from nanovllm_tp/data/corpus.txt sent as strings), each request with ignore_eos (vLLM's extra
field) and its max_tokens; `--dataset shared-prefix`: each random prompt after one of --num-prefixes random
"system prompts" of --prefix-len tokens (the prefix cache's case; the hit rate, from the server's
prefix_cache_hits / prefix_cache_queries counters, is reported per load point). Load as in bench_latency: Poisson arrivals at --request-rate (inf = all at once,
--concurrency then caps the requests in flight) or a closed loop of --concurrency requests.

--launch starts our own server (launch/serve, through launch/serve_process) on a free 127.0.0.1 port with the
engine flags given here (and --data-parallel-size D replicas; with several --router policies, one server
each, run in turn on the same prompts), waits for /health and stops it with SIGTERM at the end. --compare-offline (with --launch)
also runs every load point through the offline engine in this process (bench_latency.run_point: add_request/step,
same workload, same flags), interleaved with the server runs over --repeats; medians are reported with the
server/offline ratios of output tok/s and of TPOT p50. `--api chat` streams /v1/chat/completions (one user message
per prompt, through the chat template) instead of /v1/completions; offline generation runs the same texts as raw
prompts (their decode steps, which TPOT times, are the same).

TTFT = first streamed text - send time; ITL = gaps between streamed chunks; TPOT = (last - first) /
(output tokens - 1); output tokens from the usage of the final chunk.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import time

from nanovllm_tp.bench import common as bc
from nanovllm_tp.bench import latency as bench_latency
from nanovllm_tp.bench.latency import QUANTILES, arrival_offsets, label, load_points, run_point
from nanovllm_tp.config.engine_config import add_engine_args, engine_argv
from nanovllm_tp.launch import serve_process
from nanovllm_tp.launch.make_tiny import CORPUS
from nanovllm_tp.serving.router import POLICIES, ReplicaLoad, make_router
from nanovllm_tp.utils.trace import sibling_path

NAME = "bench_serve"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)     # --model: the model name sent to --base-url, or a directory: the model's files
    # (random prompts stay inside its vocabulary; the name comes from the server), and the model with --launch
    srv = parser.add_argument_group("server")
    srv.add_argument("--base-url", help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    srv.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    srv.add_argument("--launch", action="store_true", help="start our own server on a free port for the run")
    srv.add_argument("--compare-offline", action="store_true", help="with --launch: also run offline generation")
    srv.add_argument("--data-parallel-size", type=int, default=1, help="with --launch: engine replicas")
    srv.add_argument("--router", nargs="+", choices=list(POLICIES), default=["prefix-aware"],
                     help="with --launch and --data-parallel-size > 1: the routing policies compared")
    srv.add_argument("--server-args", default="", help="with --launch: more serve flags, one string "
                                                       "(e.g. \"--http-priority normal\")")
    bc.add_workload_args(parser, num_requests=64)
    parser.add_argument("--dataset", choices=["random", "text", "shared-prefix"], default="random")
    parser.add_argument("--api", choices=["completions", "chat"], default="completions",
                        help="chat: each prompt as one user message to /v1/chat/completions, streamed as the "
                             "openai client streams a chat (needs --dataset text)")
    parser.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: distinct prefixes")
    parser.add_argument("--prefix-len", type=int, default=600, help="shared-prefix: tokens in each prefix")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, nargs="+", help="Poisson arrival rate(s), requests/s (inf ok)")
    load.add_argument("--concurrency", type=int, nargs="+", help="requests in flight (closed loop, or a cap)")
    parser.add_argument("--repeats", type=int, default=1)
    bc.add_output_args(parser)
    return parser


# =============================================================================================== workload

def text_prompts(workload: bc.Workload, draw: int) -> list[str]:
    """Windows of the corpus, as many words as the prompt length (roughly as many tokens)."""
    words = CORPUS.read_text().split()
    rng = random.Random(f"{workload.seed}/text/{draw}")
    out = []
    for n in workload.prompt_lens:
        i = rng.randrange(0, max(1, len(words) - n))
        out.append(" ".join(words[i:i + n]))
    return out


def prompts_for(args, workload: bc.Workload, draw: int):
    if args.dataset == "shared-prefix":
        return bc.shared_prefix_prompts(workload, draw, args.num_prefixes, args.prefix_len)
    return text_prompts(workload, draw) if args.dataset == "text" else workload.prompts(draw)


def prefix_counters(args) -> tuple[float, float]:
    """(prefix_cache_hits, prefix_cache_queries) in tokens, summed over the server's replicas; (0, 0) for a
    server without them (a peer)."""
    import httpx
    root = args.base_url.removesuffix("/v1")
    try:
        text = httpx.get(f"{root}/metrics", timeout=30).text
    except httpx.HTTPError:
        return 0.0, 0.0
    total = {"hits": 0.0, "queries": 0.0}
    for line in text.splitlines():
        for key in total:
            if line.startswith(f"nanovllm_tp:prefix_cache_{key}_total"):
                total[key] += float(line.rsplit(" ", 1)[1])
    return total["hits"], total["queries"]


# =============================================================================================== client

async def one_request(session, args, prompt, max_tokens: int, arrived: float, start: float) -> dict:
    chat = args.api == "chat"
    body = {"model": args.model_name, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True},
            **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})}
    times, tokens, error = [], None, None
    async with session.post(f"{args.base_url}/{'chat/completions' if chat else 'completions'}", json=body) as resp:
        if resp.status != 200:
            error = f"{resp.status}: {(await resp.read()).decode(errors='replace')[:200]}"
        else:
            async for line in resp.content:          # one SSE line at a time
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices") and (chunk["choices"][0].get("delta", {}).get("content") if chat else
                                             chunk["choices"][0].get("text")):
                    times.append(time.perf_counter())
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = times[0] if times else None
    return {"output_tokens": tokens, "arrival": arrived - start, "finish": end - start, "error": error,
            "ttft": first - arrived if first else None,
            "tpot": (times[-1] - first) / (tokens - 1) if first and tokens and tokens > 1 else None,
            "itl": [b - a for a, b in zip(times, times[1:])], "e2e": end - arrived}


async def run_server_point(args, workload: bc.Workload, prompts, point: dict) -> dict:
    """The client is aiohttp (its HTTP parser is C): on a small machine the client shares the server's cores, and
    every cycle it spends is taken from the engine."""
    try:
        import aiohttp
    except ImportError:
        raise SystemExit("bench serve's client needs aiohttp: pip install 'nanovllm-tp[bench]'") from None
    n = workload.num_requests
    offsets = arrival_offsets(n, point["request_rate"], args.seed) if point["mode"] == "poisson" else [0.0] * n
    cap = asyncio.Semaphore(point["concurrency"] or n)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout) as session:
        start, cpu0 = time.perf_counter(), time.process_time()

        async def go(i):
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            arrived = start + offsets[i]
            async with cap:
                if point["mode"] == "closed":
                    arrived = time.perf_counter()
                return await one_request(session, args, prompts[i], workload.output_lens[i], arrived, start)

        records = await asyncio.gather(*(go(i) for i in range(n)))
        client_cpu = time.process_time() - cpu0
    duration = max(r["finish"] for r in records)
    out_tokens = sum(r["output_tokens"] or 0 for r in records)
    return {"label": label(point), **point, "duration_s": duration, "request_throughput": n / duration,
            "output_tok_s": out_tokens / duration, "client_cpu_s": client_cpu,
            "errors": sum(r["error"] is not None for r in records),
            "lengths_ok": [r["output_tokens"] for r in records] == workload.output_lens,
            "ttft": bc.summarize([r["ttft"] for r in records]), "tpot": bc.summarize([r["tpot"] for r in records]),
            "itl": bc.summarize([g for r in records for g in r["itl"]]),
            "e2e": bc.summarize([r["e2e"] for r in records]),
            "requests": [{k: v for k, v in r.items() if k != "itl"} for r in records]}


# =============================================================================================== the server

def served_model(args) -> dict:
    """The server's first model card (GET /models)."""
    import httpx
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.get(f"{args.base_url}/models", headers=headers, timeout=30).json()["data"][0]


def prompt_vocab_size(args, card: dict) -> int:
    """Random prompt ids stay inside the vocabulary of --model (a directory or a .gguf file), else of the model the
    server names as its root (ours and vLLM's do) when it is on this machine; else below MAX_TOKEN_ID + 1."""
    for path in (args.model, card.get("root")):
        if isinstance(path, str) and (os.path.isfile(os.path.join(path, "config.json")) or
                                      (path.endswith(".gguf") and os.path.isfile(path))):
            return bc.model_vocab_size(path)
    if args.dataset == "random":
        bc.log(args, f"warning: the model's vocabulary is unknown here; random prompt ids go up to "
                     f"{bc.MAX_TOKEN_ID} (give --model DIR, or --dataset text)")
    return bc.MAX_TOKEN_ID + 1


# =============================================================================================== report

def router_cost_us(policy: str, replicas: int, prompts) -> float | None:
    """The router's own cost per request: the median microseconds of building the replicas' loads and routing,
    as the HTTP process does before it hands a request on, over this workload's prompts in order (the
    prefix-aware record fills as it would). None for text prompts (the server routes their token ids)."""
    if not prompts or not isinstance(prompts[0], list):
        return None
    router = make_router(policy, replicas)
    times = []
    for prompt in prompts:
        start = time.perf_counter_ns()
        router.route(prompt, [ReplicaLoad() for _ in range(replicas)])
        times.append(time.perf_counter_ns() - start)
    return bc.median(times) / 1e3


def medians(runs: list[dict]) -> dict:
    """The median run figures over repeats (each quantile separately)."""
    out = {"label": runs[0]["label"], "repeats": len(runs),
           "output_tok_s": bc.median([r["output_tok_s"] for r in runs]),
           "request_throughput": bc.median([r["request_throughput"] for r in runs]),
           "lengths_ok": all(r["lengths_ok"] for r in runs)}
    rates = [r["prefix_hit_rate"] for r in runs if r.get("prefix_hit_rate") is not None]
    out["prefix_hit_rate"] = bc.median(rates) if rates else None
    for m in ("ttft", "tpot", "itl", "e2e"):
        if m in runs[0]:
            out[m] = {q: bc.median([r[m][q] for r in runs]) for q in QUANTILES}
    return out


def table(result: dict) -> str:
    rows = []
    hit_rates = any(p["server"].get("prefix_hit_rate") is not None for p in result["figures"]["points"])
    routed = any("router_us" in p for p in result["figures"]["points"])
    for p in result["figures"]["points"]:
        s, o = p["server"], p.get("offline")
        ms = [None if s[m][q] is None else s[m][q] * 1e3 for m in ("ttft", "tpot", "itl") for q in QUANTILES]
        extra = [o["output_tok_s"], s["output_tok_s"] / o["output_tok_s"], o["ttft"]["p50"] * 1e3,
                 None if o["tpot"]["p50"] is None else o["tpot"]["p50"] * 1e3,
                 None if not (o["tpot"]["p50"] and s["tpot"]["p50"]) else s["tpot"]["p50"] / o["tpot"]["p50"]] \
            if o else []
        hit = [] if not hit_rates else [None if s["prefix_hit_rate"] is None else 100 * s["prefix_hit_rate"]]
        cost = [] if not routed else [p.get("router_us"), None if p.get("router_us") is None or not s["tpot"]["p50"]
                                      else p["router_us"] / 1e4 / s["tpot"]["p50"]]
        rows.append([p["label"], s["request_throughput"], s["output_tok_s"], *hit, *ms, *cost, *extra])
    headers = ["load", "req/s", "out tok/s"] + (["prefix hit %"] if hit_rates else []) + \
        [f"{m} {q}" for m in ("TTFT", "TPOT", "ITL") for q in QUANTILES] + \
        (["router us/req", "router % of TPOT p50"] if routed else [])
    if result["figures"]["points"] and result["figures"]["points"][0].get("offline"):
        headers += ["offline tok/s", "server/offline", "offline TTFT p50", "offline TPOT p50",
                    "TPOT p50 server/offline"]
    w = result["workload"]
    title = (f"bench_serve: {w['num_requests']} requests, prompt {w['prompt_len_min']}..{w['prompt_len_max']}, "
             f"output {w['output_len_min']}..{w['output_len_max']}, medians of {result['config']['repeats']}; ms")
    return bc.format_table(headers, rows, title)


def draw(result: dict):
    """bench_latency's TTFT / TPOT plot, over the server's median figures."""
    runs = [{"label": p["label"], **p["server"]} for p in result["figures"]["points"]]
    return bench_latency.draw({"figures": {"runs": runs}})


# =============================================================================================== main

def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    points = load_points(args)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.api == "chat" and args.dataset != "text":
        raise SystemExit("--api chat sends text: give --dataset text")
    if not args.launch and (not args.base_url or args.compare_offline):
        raise SystemExit("give --base-url, or --launch (needed by --compare-offline)")
    bc.apply_threads(args)
    proc, llm = None, None
    if args.launch:
        args.model = bc.resolve_model(args)
    env = bc.environment()
    out_path = bc.out_path(args, NAME)
    routers = args.router if args.launch and args.data_parallel_size > 1 else [None]
    if len(routers) > 1 and args.compare_offline:
        raise SystemExit("--compare-offline compares one server: give one --router")
    combos = [(router, point) for router in routers for point in points]
    server_runs = [[] for _ in combos]
    offline_runs = [[] for _ in combos]
    workload = None
    try:
        for ri, router in enumerate(routers):       # one server per policy, in turn, on the same prompts
            if args.launch:
                dp = ["--data-parallel-size", str(args.data_parallel_size), "--router", router] if router else []
                proc, args.base_url = serve_process.start(engine_argv(args) + dp + shlex.split(args.server_args),
                                                          args.api_key)
                bc.log(args, f"server at {args.base_url}" + (f" ({args.data_parallel_size} replicas, {router})"
                                                             if router else ""))
            if workload is None:
                card = served_model(args)
                by_name = args.model and not args.launch and not os.path.isdir(args.model)
                args.model_name = args.model if by_name else card["id"]
                vocab = prompt_vocab_size(args, card)
                workload = bc.make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len),
                                            args.seed, vocab)
            warm = {"mode": "closed", "request_rate": None, "concurrency": 4}
            warm_workload = bc.make_workload(4, (8, 32), (8, 8), args.seed + 1, vocab)
            warm_prompts = text_prompts(warm_workload, 0) if args.api == "chat" else warm_workload.prompts()
            asyncio.run(run_server_point(args, warm_workload, warm_prompts, warm))
            if args.compare_offline and llm is None:           # built while the server idles
                from nanovllm_tp.bench.engine import warm_up_engine
                from nanovllm_tp.launch.generate import build_llm
                if args.trace_path:                 # the server writes args.trace_path; this engine writes beside it
                    args.trace_path = sibling_path(args.trace_path, "offline")
                llm = build_llm(args)
                warm_up_engine(llm, vocab, args.seed, args.temperature)
            draw_no = 0
            for r in range(args.repeats):
                for k, point in enumerate(points):
                    draw_no += 1
                    prompts = prompts_for(args, workload, draw_no)
                    hits, queries = prefix_counters(args)
                    run = asyncio.run(run_server_point(args, workload, prompts, point))
                    hits2, queries2 = prefix_counters(args)
                    run["prefix_hit_rate"] = (hits2 - hits) / (queries2 - queries) if queries2 > queries else None
                    if router:
                        run["label"] = f"{router} {run['label']}"
                    server_runs[ri * len(points) + k].append(run)
                    bc.log(args, f"[{r + 1}/{args.repeats}] server {run['label']}: {run['output_tok_s']:.1f} tok/s, "
                                 f"TTFT p50 {(run['ttft']['p50'] or 0) * 1e3:.1f} ms, "
                                 f"client CPU {run['client_cpu_s']:.1f} s, errors {run['errors']}"
                                 + ("" if run["prefix_hit_rate"] is None else
                                    f", prefix hits {run['prefix_hit_rate']:.1%}"))
                    if llm is not None:
                        off = run_point(llm, workload, prompts, point, args.temperature, args.seed)
                        off.pop("requests")
                        offline_runs[ri * len(points) + k].append(off)
                        bc.log(args, f"[{r + 1}/{args.repeats}] offline {off['label']}: {off['output_tok_s']:.1f} "
                                     f"tok/s, TTFT p50 {off['ttft']['p50'] * 1e3:.1f} ms")
            if proc is not None:
                serve_process.stop(proc)
                proc = None
    finally:
        if llm is not None:
            llm.close()
        if proc is not None:
            serve_process.stop(proc)
    figures = []
    for k in range(len(combos)):
        p = {"label": server_runs[k][0]["label"], "server": medians(server_runs[k]), "server_runs": server_runs[k]}
        if combos[k][0] is not None:
            p["router_us"] = router_cost_us(combos[k][0], args.data_parallel_size, prompts_for(args, workload, 1))
        if offline_runs[k]:
            p["offline"] = medians(offline_runs[k])
            p["offline_runs"] = offline_runs[k]
            p["server_over_offline_tok_s"] = p["server"]["output_tok_s"] / p["offline"]["output_tok_s"]
            p["ttft_p50_minus_offline_s"] = p["server"]["ttft"]["p50"] - p["offline"]["ttft"]["p50"]
            so, oo = p["server"]["tpot"]["p50"], p["offline"]["tpot"]["p50"]
            p["tpot_p50_server_over_offline"] = so / oo if so and oo else None
        figures.append(p)
    config = bc.config_dict(args)
    config.pop("api_key", None)
    result = {"name": NAME, "config": config, "workload": workload.describe(),
              "environment": bc.finish_environment(env),
              "figures": {"points": figures, "units": "seconds (table: ms)",
                          "definitions": {"ttft": "first streamed text - send (or Poisson arrival) time",
                                          "tpot": "(last chunk - first chunk) / (output_tokens - 1)",
                                          "itl": "gaps between streamed chunks", "e2e": "end of stream - arrival"}}}
    bc.save_result(args, out_path, result, draw)
    print(table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
