"""One command for the CUDA path: greedy tokens against transformers, and throughput figures for BENCHMARKS.md.

    bash scripts/gpu_check.sh [--dry-run] [--skip tput] [--part exact]    # --part: one part, in this process

Each part runs in a process of its own (a CUDA fault cannot poison the next) under a cap drawn from --budget and
adds rows to one markdown table, printed last and written to gpu_check.md under --out (else $OUT, else results/),
beside gpu_check.json (environment, timings) and gpu_check.log. Tokens and logprobs come from LLM.generate, engine
facts (backend, block size, graphs, preemptions, prefix-cache hits) from LLM.stats(). The dry run covers the same
rows on the CPU (cpu backend, no graphs, gloo; fp16 skipped). The parts: pytest here, exact and tp2 in
gpu_check_exact.py, tput in gpu_check_tput.py; what they share (sizes, rows, token comparison) in gpu_check_rows.py.
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
          continuous batching (bench/hf.py's driver) on the first 64 requests
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
from dataclasses import asdict

from nanovllm_tp.bench import common as bc
from nanovllm_tp.launch.gpu_check_exact import VARIANTS, check_variant, part_exact
from nanovllm_tp.launch.gpu_check_rows import DRY, GPU, Row, Sizes, compare_tokens, first_diff, greedy
from nanovllm_tp.launch.gpu_check_tput import part_tput

__all__ = ["main", "PARTS", "VARIANTS", "check_variant", "compare_tokens", "first_diff", "greedy", "Row", "Sizes",
           "GPU", "DRY", "table"]
REPO = pathlib.Path(__file__).resolve().parents[1]
PARTS = {"pytest": 150, "exact": 100, "tp2": 60, "tput": 300}       # part -> its time cap in seconds


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
