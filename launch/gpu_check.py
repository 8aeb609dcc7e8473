"""One command for the CUDA path: greedy tokens against transformers, and throughput figures for BENCHMARKS.md.

    bash scripts/gpu_check.sh                 # a CUDA machine: every part below (about 6 minutes on an H200)
    bash scripts/gpu_check.sh --dry-run       # CPU: the same driver on the tiny checkpoint, small sizes
    python -m nanovllm_tp.launch.gpu_check --part exact --dry-run     # one part, in this process

Each part runs in a process of its own (a CUDA fault in one cannot poison the next) under a time cap drawn from
--budget, and adds rows (part, check, result, status) to one table: printed last and written to gpu_check.md,
with the environment in gpu_check.json and every part's output in gpu_check.log, under --out ($OUT, else
results/). Only the public API is used: tokens and logprobs from LLM.generate, engine facts from LLM.stats().

Checked (the dry run runs the same rows on the CPU: cpu backend, no graphs, gloo, fp16 skipped):
  pytest  tests/gpu: graph replay vs eager forward and its padding rows, Triton paged decode (split-K) and
          prefill kernels, torch varlen prefill and flash-attn against a dense fp32 reference, KV sizing from
          free memory, replays that allocate nothing, the backend picked by block size
  exact   greedy tokens of the tiny checkpoint vs transformers fp32 on the CPU, 16 prompts of 1..300 tokens:
          fp32, token for token (first-token logprobs within 1e-2 std of the reference's):
            [x] torch-cuda, block 16, CUDA graphs     [x] enforce_eager
            [x] prefix-cache hits: a second pass over the same prompts (hit tokens > 0)
            [x] chunked prefill: max_num_batched_tokens 64
            [x] preemption: 40 KV blocks for the batch (preemptions > 0)
          half precision: at most 1 prompt in 8 differs at its first token, logprobs within 0.25 std:
            [x] bf16, default block: flash-attn at 256 when installed, else torch-cuda at 16; graphs
            [x] bf16, block 16: torch-cuda            [x] fp16, block 128, graphs
  tp2     tensor_parallel_size=2 (NCCL; gloo in the dry run): the fp32 graphs and bf16 default rows above;
          skipped with fewer than 2 GPUs
  tput    a Qwen3-0.6B-shaped random model in bf16 (make_tiny preset qwen3-0.6b): graphs vs enforce_eager greedy
          tokens on 16 prompts; output tok/s of both on nano-vllm's bench workload (256 requests, prompt and
          output lengths 100..1024, ignore_eos) and graph speed-up; engine vs transformers' continuous batching
          (launch/bench.py's driver) on the first 64 requests
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from nanovllm_tp.launch import bench_common as bc

REPO = pathlib.Path(__file__).resolve().parents[1]
PARTS = {"pytest": 150, "exact": 100, "tp2": 60, "tput": 300}       # part -> its time cap in seconds
HALF_LOGPROB_TOL, FP32_LOGPROB_TOL = 0.25, 1e-2     # |engine - reference| / std(reference), first position
# Engine settings of the exactness rows: 40 blocks of 16 fp32 tokens of the tiny checkpoint (32 KiB each,
# plus the null block) hold one 512-token sequence but never the whole batch, so decodes must preempt.
BASE = dict(max_model_len=512, max_num_seqs=16, kvcache_block_size=16, kv_cache_memory=256 << 20)
TIGHT_KV = 41 * (32 << 10)
# check, dtype, LLM arguments over BASE, what LLM.stats() must show afterwards
VARIANTS = [("fp32, block 16, graphs", "float32", {}, "graphs"),
            ("fp32, enforce_eager", "float32", {"enforce_eager": True}, "eager"),
            ("fp32, prefix-cache hits", "float32", {}, "hits"),
            ("fp32, chunked prefill", "float32", {"max_num_batched_tokens": 64}, ""),
            ("fp32, preemption", "float32", {"kv_cache_memory": TIGHT_KV}, "preemptions"),
            ("bf16, default block", "bfloat16", {"kvcache_block_size": None}, "graphs"),
            ("bf16, block 16", "bfloat16", {}, "graphs"),
            ("fp16, block 128", "float16", {"kvcache_block_size": 128}, "graphs")]
TP2_VARIANTS = [VARIANTS[0], VARIANTS[5]]


@dataclass(slots=True)
class Sizes:
    prompts: int                 # exactness prompts
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    preset: str                  # throughput checkpoint (make_tiny preset)
    requests: int                # throughput workload
    lens: tuple[int, int]        # its prompt and output lengths
    hf_requests: int             # the first N of it, for transformers
    check_tokens: int            # graphs vs eager: the first prompt's tokens; 3 fewer for each next one


GPU = Sizes(16, (1, 300), (8, 32), "qwen3-0.6b", 256, (100, 1024), 64, 64)
DRY = Sizes(8, (1, 160), (4, 12), "tiny", 12, (8, 48), 4, 24)


@dataclass(slots=True)
class Row:
    part: str
    check: str
    result: str
    status: str         # PASS, FAIL, SKIP or INFO (a figure)


@dataclass(slots=True)
class Reference:
    prompts: list[list[int]]
    lens: list[int]
    tokens: list[list[int]]
    logprobs: list          # per prompt: the first generated position's log-softmax over the vocabulary


# =============================================================================================== comparison

def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), else None."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def compare_tokens(got: list[list[int]], want: list[list[int]], within: int | None = None) -> tuple[str, str]:
    """PASS or FAIL, and a summary, for greedy tokens against a reference, prompt by prompt. within=None: every
    token must match. within=k (half precision, where a near-tie may flip): at most 1 prompt in 8 may differ in
    its first k tokens; a real fault (a wrong KV slot, a stale graph input) breaks most prompts at once."""
    if len(got) != len(want):
        return "FAIL", f"{len(got)} outputs for {len(want)} prompts"
    diffs = {i: d for i, (a, b) in enumerate(zip(got, want)) if (d := first_diff(a, b)) is not None}
    summary = f"{len(got) - len(diffs)}/{len(got)} identical" + (f", first differences {diffs}" if diffs else "")
    if within is None:
        return ("FAIL" if diffs else "PASS"), summary
    early = sum(d < within for d in diffs.values())
    return ("FAIL" if early > len(got) // 8 else "PASS"), summary + (f", {early} within {within} tokens" if diffs else "")


def logprob_error(got, ref: Reference) -> float:
    """max |engine - reference| over the engine's top logprobs at each prompt's first position, in units of the
    reference's std over the vocabulary (std of logprobs = std of logits)."""
    return max(abs(lp.logprob - float(want[t])) / float(want.std())
               for positions, want in zip(got, ref.logprobs) for t, lp in positions[0].items())


# =============================================================================================== engine runs

def greedy(llm, prompts, lens, logprobs: int | None = None):
    from nanovllm_tp import SamplingParams
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=logprobs) for m in lens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def reference(model: str, sizes: Sizes) -> Reference:
    """transformers fp32 on the CPU: greedy tokens and the first position's logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    from nanovllm_tp.launch.make_tiny import hf_greedy
    w = bc.make_workload(sizes.prompts, sizes.prompt_len, sizes.output_len, 5, bc.model_vocab_size(model))
    prompts = w.prompts(draw=1)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        first = [hf(torch.tensor([p])).logits[0, -1].float().log_softmax(-1) for p in prompts]
    return Reference(prompts, w.output_lens, [hf_greedy(hf, p, m) for p, m in zip(prompts, w.output_lens)], first)


def check_variant(part: str, model: str, device: str, ref: Reference, variant, tp: int = 1) -> Row:
    from nanovllm_tp import LLM
    check, dtype, kwargs, expect = variant
    if dtype == "float16" and device == "cpu":
        return Row(part, check, "float16 runs on CUDA only", "SKIP")
    try:
        llm = LLM(model, tensor_parallel_size=tp, dtype=dtype, device=device, **{**BASE, **kwargs})
        try:
            for _ in range(2 if expect == "hits" else 1):      # the second pass finds the prompts cached
                tokens, logprobs = greedy(llm, ref.prompts, ref.lens, logprobs=5)
            stats = llm.stats()
        finally:
            llm.close()
    except Exception as exc:        # one broken row must not hide the others
        return Row(part, check, f"{type(exc).__name__}: {exc}"[:300], "FAIL")
    half = dtype != "float32"
    status, summary = compare_tokens(tokens, ref.tokens, 1 if half else None)
    err = logprob_error(logprobs, ref)
    if err > (HALF_LOGPROB_TOL if half else FP32_LOGPROB_TOL):
        status = "FAIL"
    graphs = stats["cuda_graph_batch_sizes"]
    shown = {"graphs": bool(graphs) or device == "cpu", "eager": graphs is None,
             "hits": stats["prefix_cache_hit_tokens"] > 0, "preemptions": stats["num_preemptions"] > 0, "": True}
    if not shown[expect]:
        status, summary = "FAIL", f"{summary}; LLM.stats() shows no {expect}"
    return Row(part, check, f"{summary}; logprob err {err:.1e}; {stats['attention_backend']} block "
                            f"{stats['kv_block_size']}, graphs {graphs}, {stats['num_preemptions']} preemptions, "
                            f"{stats['prefix_cache_hit_tokens']} hit tokens", status)


# =============================================================================================== parts

def part_pytest(sizes: Sizes, device: str, add) -> None:
    import pytest

    class Counts(dict):
        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.outcome != "passed":
                self[report.outcome] = self.get(report.outcome, 0) + 1

    counts = Counts()
    rc = pytest.main([str(REPO / "tests" / "gpu"), "-q", "-rsfE", "-p", "no:cacheprovider"], plugins=[counts])
    status = "FAIL" if rc not in (0, 5) else ("PASS" if counts.get("passed") else "SKIP")
    add(Row("pytest", "tests/gpu", ", ".join(f"{v} {k}" for k, v in counts.items()) or f"exit code {rc}", status))


def part_exact(sizes: Sizes, device: str, add, part: str = "exact", tp: int = 1) -> None:
    from nanovllm_tp.launch.make_tiny import ensure_tiny
    model = str(ensure_tiny("tiny"))
    ref = reference(model, sizes)
    for variant in (VARIANTS if tp == 1 else TP2_VARIANTS):
        add(check_variant(part, model, device, ref, variant, tp))


def part_tp2(sizes: Sizes, device: str, add) -> None:
    import torch
    if device == "cuda" and torch.cuda.device_count() < 2:
        add(Row("tp2", "tensor_parallel_size=2", f"needs 2 GPUs, found {torch.cuda.device_count()}", "SKIP"))
        return
    part_exact(sizes, device, add, "tp2", 2)


def part_tput(sizes: Sizes, device: str, add) -> None:
    import torch

    from nanovllm_tp import LLM
    from nanovllm_tp.launch import bench
    from nanovllm_tp.launch.make_tiny import ensure_tiny
    model = str(ensure_tiny(sizes.preset))
    vocab = bc.model_vocab_size(model)
    dtype = "float32" if device == "cpu" else "bfloat16"
    w = bc.make_workload(sizes.requests, sizes.lens, sizes.lens, 0, vocab)
    k = min(sizes.hf_requests, sizes.requests)
    sub = bc.Workload(w.prompt_lens[:k], w.output_lens[:k], w.seed, vocab)
    prompts, check = w.prompts(draw=1), w.prompts(draw=2)[:16]
    check_lens = [max(1, sizes.check_tokens - 3 * i) for i in range(len(check))]   # the decode batch shrinks
    extra = dict(kv_cache_memory=64 << 20, max_model_len=1024) if device == "cpu" else {}
    runs, tokens = {}, {}
    for mode in ("graphs", "eager"):
        llm = LLM(model, dtype=dtype, device=device, enforce_eager=mode == "eager", enable_prefix_caching=False,
                  **extra)
        try:
            stats = llm.stats()
            tokens[mode] = greedy(llm, check, check_lens)[0]
            bench.warm_up_engine(llm, vocab, 0, 0.0)
            runs[mode] = bench.run_engine(llm, w, prompts, 0.0)
            if mode == "graphs":
                runs["subset"] = bench.run_engine(llm, sub, prompts[:k], 0.0)
        finally:
            llm.close()
        run = runs[mode]
        add(Row("tput", f"engine tok/s, {mode}", f"{run['tok_s']:,.0f} ({w.num_requests} requests, "
                f"{w.requested_output_tokens} tokens in {run['seconds']:.1f}s; {stats['attention_backend']} block "
                f"{stats['kv_block_size']}, graphs {stats['cuda_graph_batch_sizes']})",
                "INFO" if run["lengths_ok"] else "FAIL"))
    status, summary = compare_tokens(tokens["graphs"], tokens["eager"], None if dtype == "float32" else 8)
    add(Row("tput", f"graphs vs eager tokens ({dtype})", summary, status))
    add(Row("tput", "graph speed-up", f"{runs['graphs']['tok_s'] / runs['eager']['tok_s']:.2f}x", "INFO"))
    hf = bench.HFRunner(model, getattr(torch, dtype), torch.device(device), 0.0, 0, 512 if device == "cpu" else 8192)
    hf.warm_up(vocab, ["cb"])
    cb = hf.generate_cb(sub, prompts[:k])
    add(Row("tput", "transformers CB tok/s", f"{cb['tok_s']:,.0f} (first {k} requests, {sub.requested_output_tokens} "
            f"tokens in {cb['seconds']:.1f}s, {hf.attn_implementation})", "INFO" if cb["lengths_ok"] else "FAIL"))
    add(Row("tput", "engine / transformers CB", f"{runs['subset']['tok_s'] / cb['tok_s']:.2f}x (first {k} "
            f"requests, engine {runs['subset']['tok_s']:,.0f} tok/s)", "INFO"))


PART_RUNNERS = {"pytest": part_pytest, "exact": part_exact, "tp2": part_tp2, "tput": part_tput}


# =============================================================================================== driver

def table(rows: list[Row], title: str) -> str:
    """The one table: markdown, pasted as is into BENCHMARKS.md."""
    lines = [title, "", "| part | check | result | status |", "|---|---|---|---|"]
    return "\n".join(lines + [f"| {r.part} | {r.check} | {r.result} | {r.status} |" for r in rows])


def run_part(args) -> int:
    """One part in this process; its rows go to --json after each one, so a part stopped midway keeps them."""
    rows = []

    def add(row: Row) -> None:
        rows.append(row)
        print(f"[{row.part}] {row.check}: {row.status} {row.result}", flush=True)
        if args.json:
            bc.write_json(args.json, {"rows": [dataclasses.asdict(r) for r in rows]})

    PART_RUNNERS[args.part](DRY if args.dry_run else GPU, "cpu" if args.dry_run else "cuda", add)
    return 0


def spawn_part(part: str, args, json_path: pathlib.Path, log, timeout: float) -> int | None:
    """The part in its own process group (through scripts/gpu_check.sh, which also serves a bare checkout);
    its exit code, or None when it ran out of time. Nothing of it outlives this call."""
    cmd = ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--part", part, "--json", str(json_path)]
    cmd += ["--dry-run"] if args.dry_run else []
    log.write(f"\n===== {' '.join(cmd)} (cap {timeout:.0f}s)\n")
    log.flush()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHON": sys.executable})
    rc = None
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)         # the engine closes cleanly on SIGTERM
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)     # whatever is left of its group
        except ProcessLookupError:
            pass
        proc.wait()
    return rc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU: the tiny checkpoint, small sizes, fp32 and bf16")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for every part together (default 540)")
    p.add_argument("--skip", default="", help=f"comma-separated parts to skip: {','.join(PARTS)}")
    p.add_argument("--out", help="folder for gpu_check.md/.json/.log (default $OUT, else results/)")
    p.add_argument("--part", choices=list(PARTS), help="run one part in this process")
    p.add_argument("--json", help="with --part: where its rows go")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if skip - PARTS.keys():
        raise SystemExit(f"--skip: unknown parts {sorted(skip - PARTS.keys())}; the parts are {list(PARTS)}")
    if args.part:
        return run_part(args)
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("torch sees no CUDA device: --dry-run runs the same checks on the CPU")
    out = pathlib.Path(args.out or os.environ.get("OUT") or "results")
    out.mkdir(parents=True, exist_ok=True)
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
    for name in ("flash_attn", "triton"):
        try:
            env[name] = version(name)
        except PackageNotFoundError:
            env[name] = None
    title = (f"gpu_check{' --dry-run (CPU)' if args.dry_run else ''}, {env['date']}: "
             f"{', '.join(env.get('gpus') or ['no GPU'])}; torch {env['torch']}, transformers {env['transformers']},"
             f" flash-attn {env['flash_attn'] or 'not installed'}, triton {env['triton']}; commit {env['git_commit']}")
    text = table(rows, title)
    (out / "gpu_check.md").write_text(text + "\n")
    bc.write_json(out / "gpu_check.json", {"environment": env, "dry_run": args.dry_run, "parts": parts,
                                           "rows": [dataclasses.asdict(r) for r in rows]})
    print(text, flush=True)
    return 0 if all(r.status != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
