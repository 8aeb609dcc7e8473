"""One command for the CUDA path: greedy tokens against transformers, and throughput figures for BENCHMARKS.md.

    bash scripts/gpu_check.sh [--dry-run] [--skip tput] [--part exact]    # --part: one part, in this process

Each part runs in a process of its own (a CUDA fault cannot poison the next) under a cap drawn from --budget and
adds rows to one markdown table, printed last and written to gpu_check.md under --out (else $OUT, else results/),
beside gpu_check.json (environment, timings) and gpu_check.log. Tokens and logprobs come from LLM.generate, engine
facts (backend, block size, graphs, preemptions, prefix-cache hits) from LLM.stats(). The dry run covers the same
rows on the CPU (cpu backend, no graphs, gloo; fp16 skipped).
  pytest  tests/gpu: graph replay vs eager forward and padding rows, Triton paged decode (split-K) and prefill,
          torch varlen prefill and flash-attn vs a dense fp32 reference, KV sizing, allocation-free replays
  exact   the tiny checkpoint's greedy tokens vs transformers fp32 (CPU), 16 prompts of 1..300 tokens.
          fp32, token for token, first-token logprobs within 1e-2 std:
            [x] torch-cuda, block 16, CUDA graphs      [x] enforce_eager      [x] prefix-cache hits (2nd pass)
            [x] chunked prefill (64-token steps)       [x] preemption (40 KV blocks for the batch)
          half precision, at most 1 prompt in 8 differs at its first token, logprobs within 0.25 std:
            [x] bf16, default block (flash-attn at 256 when installed, else torch-cuda at 16), graphs
            [x] bf16, block 16 (torch-cuda)            [x] fp16, block 128, graphs
  tp2     tensor_parallel_size=2, NCCL: the fp32 graphs and bf16 default rows; needs 2 GPUs (dry run: fp32, gloo)
  tput    Qwen3-0.6B-shaped random weights (make_tiny preset qwen3-0.6b), bf16: graphs vs enforce_eager tokens
          (at most 1 in 8 of 16 prompts differs in its first 8 tokens); tok/s of both on nano-vllm's bench workload
          (256 requests, prompt and output lengths 100..1024, ignore_eos), graph speed-up; engine vs transformers'
          continuous batching (launch/bench_hf.py's driver) on the first 64 requests
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from nanovllm_tp.launch import bench_common as bc

REPO = pathlib.Path(__file__).resolve().parents[1]
PARTS = {"pytest": 150, "exact": 100, "tp2": 60, "tput": 300}       # part -> its time cap in seconds
HALF_LOGPROB_TOL, FP32_LOGPROB_TOL = 0.25, 1e-2     # |engine - reference| / std(reference), first position
BASE = dict(max_model_len=512, max_num_seqs=16, kvcache_block_size=16, kv_cache_memory=256 << 20)
TIGHT_KV = 41 * (32 << 10)    # 40 tiny fp32 blocks of 16 (+ null block): one 512-token sequence, never the batch
# check, dtype, LLM arguments over BASE, what LLM.stats() must show afterwards
VARIANTS = [("fp32, block 16, graphs", "float32", {}, "graphs"),
            ("fp32, enforce_eager", "float32", {"enforce_eager": True}, "eager"),
            ("fp32, prefix-cache hits", "float32", {}, "hits"),
            ("fp32, chunked prefill", "float32", {"max_num_batched_tokens": 64}, ""),
            ("fp32, preemption", "float32", {"kv_cache_memory": TIGHT_KV}, "preemptions"),
            ("bf16, default block", "bfloat16", {"kvcache_block_size": None}, "graphs"),
            ("bf16, block 16", "bfloat16", {}, "graphs"),
            ("fp16, block 128", "float16", {"kvcache_block_size": 128}, "graphs")]


@dataclass(slots=True)
class Sizes:
    prompts: int                    # exactness prompts, their lengths and output lengths
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    preset: str                     # throughput: make_tiny preset, requests, their prompt and output lengths
    requests: int
    lens: tuple[int, int]
    hf_requests: int                # the first N requests, also run by transformers


GPU = Sizes(16, (1, 300), (8, 32), "qwen3-0.6b", 256, (100, 1024), 64)
DRY = Sizes(8, (1, 160), (4, 12), "tiny", 12, (8, 48), 4)


@dataclass(slots=True)
class Row:
    part: str
    check: str
    result: str
    status: str         # PASS, FAIL, SKIP or INFO (a figure)


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), else None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def compare_tokens(got: list[list[int]], want: list[list[int]], within: int | None = None) -> tuple[str, str]:
    """PASS or FAIL, and a summary, for greedy tokens against a reference, prompt by prompt. within=None: every
    token must match. within=k (half precision, where a near-tie may flip): at most 1 prompt in 8 may differ in
    its first k tokens; a real fault (a wrong KV slot, a stale graph input) breaks most prompts at once."""
    if len(got) != len(want):
        return "FAIL", f"{len(got)} outputs for {len(want)} prompts"
    diffs = {i: d for i, (a, b) in enumerate(zip(got, want)) if (d := first_diff(a, b)) is not None}
    summary = f"{len(got) - len(diffs)}/{len(got)} identical" + (f", first differences {diffs}" if diffs else "")
    early = len(diffs) if within is None else sum(d < within for d in diffs.values())
    return ("PASS" if early <= (0 if within is None else len(got) // 8) else "FAIL"), summary


def greedy(llm, prompts, lens, logprobs: int | None = None):
    from nanovllm_tp import SamplingParams
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=logprobs) for m in lens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def check_variant(part: str, model: str, device: str, ref, variant, tp: int) -> Row:
    """One engine against the reference: tokens, first-position logprobs (max |diff| over the engine's top 5,
    in units of the reference's std over the vocabulary) and what LLM.stats() says it did."""
    from nanovllm_tp import LLM
    (check, dtype, kwargs, expect), (prompts, lens, want, want_lp) = variant, ref
    if dtype == "float16" and device == "cpu":
        return Row(part, check, "float16 runs on CUDA only", "SKIP")
    try:
        llm = LLM(model, tensor_parallel_size=tp, dtype=dtype, device=device, **{**BASE, **kwargs})
        try:
            for _ in range(2 if expect == "hits" else 1):      # the second pass finds the prompts cached
                tokens, logprobs = greedy(llm, prompts, lens, logprobs=5)
            stats = llm.stats()
        finally:
            llm.close()
    except Exception as exc:        # one broken row must not hide the others
        return Row(part, check, f"{type(exc).__name__}: {exc}"[:300], "FAIL")
    half = dtype != "float32"
    status, summary = compare_tokens(tokens, want, 1 if half else None)
    err = max(abs(lp.logprob - float(w[t])) / float(w.std()) for pos, w in zip(logprobs, want_lp)
              for t, lp in pos[0].items())
    graphs = stats["cuda_graph_batch_sizes"]
    shown = {"graphs": bool(graphs) or device == "cpu", "eager": graphs is None, "": True,
             "hits": stats["prefix_cache_hit_tokens"] > 0, "preemptions": stats["num_preemptions"] > 0}
    if err > (HALF_LOGPROB_TOL if half else FP32_LOGPROB_TOL) or not shown[expect]:
        status = "FAIL"
    return Row(part, check, f"{summary}; logprob err {err:.1e}; {stats['attention_backend']} block "
                            f"{stats['kv_block_size']}, graphs {graphs}, {stats['num_preemptions']} preemptions, "
                            f"{stats['prefix_cache_hit_tokens']} prefix-cache hit tokens", status)


def part_pytest(sizes: Sizes, device: str, add, part: str) -> None:
    import pytest

    counts: dict[str, int] = {}

    class Counter:      # a plugin object must be hashable: pytest keeps the ones it has seen in a set
        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.outcome != "passed":
                counts[report.outcome] = counts.get(report.outcome, 0) + 1

    rc = pytest.main([str(REPO / "tests" / "gpu"), "-q", "-rsfE", "-p", "no:cacheprovider"], plugins=[Counter()])
    status = "FAIL" if rc not in (0, 5) else ("PASS" if counts.get("passed") else "SKIP")
    add(Row(part, "tests/gpu", ", ".join(f"{v} {k}" for k, v in counts.items()) or f"exit code {rc}", status))


def part_exact(sizes: Sizes, device: str, add, part: str) -> None:
    """The exactness rows ("exact" at TP=1, "tp2" at TP=2) against transformers fp32 on the CPU: prompts, output
    lengths, its greedy tokens and its log-softmax over the vocabulary at each prompt's first generated position."""
    import torch
    from transformers import AutoModelForCausalLM

    from nanovllm_tp.launch.bench_hf import hf_greedy
    from nanovllm_tp.launch.make_tiny import ensure_tiny
    if part == "tp2" and device == "cuda" and torch.cuda.device_count() < 2:
        return add(Row(part, "tensor_parallel_size=2", f"needs 2 GPUs, found {torch.cuda.device_count()}", "SKIP"))
    model = str(ensure_tiny("tiny"))
    w = bc.make_workload(sizes.prompts, sizes.prompt_len, sizes.output_len, 5, bc.model_vocab_size(model))
    prompts, hf = w.prompts(draw=1), AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        first = [hf(torch.tensor([p])).logits[0, -1].float().log_softmax(-1) for p in prompts]
    ref = prompts, w.output_lens, [hf_greedy(hf, p, m) for p, m in zip(prompts, w.output_lens)], first
    tp2 = [VARIANTS[0], VARIANTS[5]][:1 if device == "cpu" else 2]     # fp32 and bf16 graphs (fp32 on the CPU)
    for variant in (VARIANTS if part == "exact" else tp2):
        add(check_variant(part, model, device, ref, variant, 1 if part == "exact" else 2))


def part_tput(sizes: Sizes, device: str, add, part: str) -> None:
    import torch

    from nanovllm_tp import LLM
    from nanovllm_tp.launch import bench_engine, bench_hf
    from nanovllm_tp.launch.make_tiny import ensure_tiny
    model = str(ensure_tiny(sizes.preset))
    vocab, dtype, k = bc.model_vocab_size(model), ("float32" if device == "cpu" else "bfloat16"), sizes.hf_requests
    w = bc.make_workload(sizes.requests, sizes.lens, sizes.lens, 0, vocab)
    sub = bc.Workload(w.prompt_lens[:k], w.output_lens[:k], w.seed, vocab)
    prompts, check = w.prompts(draw=1), w.prompts(draw=2)[:16]
    check_lens = [max(1, 2 * sizes.output_len[1] - 3 * i) for i in range(len(check))]   # decode batch shrinks
    extra = dict(kv_cache_memory=64 << 20, max_model_len=1024) if device == "cpu" else {}
    runs, tokens = {}, {}
    for mode in ("graphs", "eager"):
        llm = LLM(model, dtype=dtype, device=device, enforce_eager=mode == "eager", enable_prefix_caching=False,
                  **extra)
        try:
            stats = llm.stats()
            tokens[mode] = greedy(llm, check, check_lens)[0]
            bench_engine.warm_up_engine(llm, vocab, 0, 0.0)
            runs[mode] = run = bench_engine.run_engine(llm, w, prompts, 0.0)
            if mode == "graphs":        # the engine on the requests transformers runs too
                runs["subset"] = bench_engine.run_engine(llm, sub, prompts[:k], 0.0)
        finally:
            llm.close()
        add(Row(part, f"engine tok/s, {mode}", f"{run['tok_s']:,.0f} ({w.num_requests} requests, "
                f"{w.requested_output_tokens} tokens, {run['seconds']:.1f}s; {stats['attention_backend']} block "
                f"{stats['kv_block_size']}, graphs {stats['cuda_graph_batch_sizes']})", "INFO" if run["lengths_ok"]
                else "FAIL"))
    status, summary = compare_tokens(tokens["graphs"], tokens["eager"], None if dtype == "float32" else 8)
    add(Row(part, f"graphs vs eager tokens ({dtype})", summary, status))
    add(Row(part, "graph speed-up", f"{runs['graphs']['tok_s'] / runs['eager']['tok_s']:.2f}x", "INFO"))
    hf = bench_hf.HFRunner(model, getattr(torch, dtype), torch.device(device), 0.0, 0, 512 if device == "cpu" else 8192)
    hf.warm_up(vocab, ["cb"])
    cb, ours = hf.generate_cb(sub, prompts[:k]), runs["subset"]
    add(Row(part, "transformers CB tok/s", f"{cb['tok_s']:,.0f} ({hf.attn_implementation}) on the first {k} requests, "
            f"engine {ours['tok_s']:,.0f}: {ours['tok_s'] / cb['tok_s']:.2f}x", "INFO" if cb["lengths_ok"] else "FAIL"))


PART_RUNNERS = {"pytest": part_pytest, "exact": part_exact, "tp2": part_exact, "tput": part_tput}


def table(rows: list[Row], title: str) -> str:
    """The one table: markdown, pasted as is into BENCHMARKS.md."""
    return "\n".join([title, "", "| part | check | result | status |", "|---|---|---|---|"]
                     + [f"| {r.part} | {r.check} | {r.result} | {r.status} |" for r in rows])


def run_part(args) -> int:
    """One part in this process; its rows go to --json after each one, so a part stopped midway keeps them."""
    rows = []

    def add(row: Row) -> None:
        rows.append(row)
        print(f"[{row.part}] {row.check}: {row.status} {row.result}", flush=True)
        if args.json:
            bc.write_json(args.json, {"rows": [asdict(r) for r in rows]})

    PART_RUNNERS[args.part](DRY if args.dry_run else GPU, "cpu" if args.dry_run else "cuda", add, args.part)
    return 0


def spawn_part(part: str, args, json_path: pathlib.Path, log, timeout: float) -> int | None:
    """The part in a process group of its own, through scripts/gpu_check.sh (which also serves a bare checkout);
    its exit code, or None when it ran out of time. Nothing of it outlives this call."""
    cmd = ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--part", part, "--json", str(json_path)]
    cmd += ["--dry-run"] if args.dry_run else []
    print(f"\n===== {' '.join(cmd)} (cap {timeout:.0f}s)", file=log, flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHON": sys.executable})
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:        # its group, whatever ended the wait: SIGTERM first (the engine closes cleanly), then SIGKILL
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU: the tiny checkpoint, small sizes, fp32 and bf16")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for every part together (default 540)")
    p.add_argument("--skip", default="", help=f"comma-separated parts to skip: {','.join(PARTS)}")
    p.add_argument("--out", help="folder for gpu_check.md/.json/.log (default $OUT, else results/)")
    p.add_argument("--part", choices=list(PARTS), help="run one part in this process")
    p.add_argument("--json", help="with --part: where its rows go")
    args = p.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if skip - PARTS.keys():
        raise SystemExit(f"--skip: unknown parts {sorted(skip - PARTS.keys())}; the parts are {list(PARTS)}")
    if args.part:
        return run_part(args)
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("torch sees no CUDA device: --dry-run runs the same checks on the CPU")
    (out := pathlib.Path(args.out or os.environ.get("OUT") or "results")).mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))     # so a running part is stopped on the way out
    deadline, rows, parts = time.time() + args.budget, [], {}
    with tempfile.TemporaryDirectory(prefix="nvtp_gpu_check_") as tmp, open(out / "gpu_check.log", "w") as log:
        for part, cap in PARTS.items():
            timeout = min(cap, deadline - time.time())
            if part in skip or timeout < 10:
                rows.append(Row(part, "-", "--skip" if part in skip else "no time left in --budget", "SKIP"))
                continue
            print(f"gpu_check: {part} (cap {timeout:.0f}s)", flush=True)
            t0, path = time.time(), pathlib.Path(tmp) / f"{part}.json"
            rc = spawn_part(part, args, path, log, timeout)
            rows += [Row(**r) for r in (json.loads(path.read_text())["rows"] if path.exists() else [])]
            if rc != 0:
                rows.append(Row(part, "process", f"out of time ({timeout:.0f}s)" if rc is None else
                                f"exit code {rc}, see gpu_check.log", "FAIL"))
            parts[part] = {"exit_code": rc, "seconds": round(time.time() - t0, 1)}
    env = bc.finish_environment(bc.environment())
    text = table(rows, f"gpu_check{' --dry-run (CPU)' if args.dry_run else ''}, {env['date']}: "
                       f"{', '.join(env.get('gpus') or ['no GPU'])}; torch {env['torch']}, transformers "
                       f"{env['transformers']}, flash-attn {env['flash_attn']}, triton {env['triton']}; "
                       f"commit {env['git_commit']}")
    (out / "gpu_check.md").write_text(text + "\n")
    bc.write_json(out / "gpu_check.json", {"environment": env, "dry_run": args.dry_run, "parts": parts,
                                           "rows": [asdict(r) for r in rows]})
    print(text, flush=True)
    return 0 if all(r.status != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
