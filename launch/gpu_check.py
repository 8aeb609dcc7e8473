"""One command that checks the CUDA path and measures throughput on one GPU (about 7 minutes on an H200).

    bash scripts/gpu_check.sh            # python -m nanovllm_tp.launch.gpu_check
    bash scripts/gpu_check.sh --smoke    # CPU: tiny model, few requests, the code paths that need no GPU

Steps, each in its own process (a CUDA fault in one cannot poison the next) under a time cap drawn from one
overall budget, each shown PASS / FAIL / SKIP / a figure in the table printed last:
  1. pytest tests/gpu
  2. eager vs CUDA-graph greedy tokens on a Qwen3-0.6B-shaped random model (16 prompts, bf16)
  3. bf16 GPU vs fp32 CPU (transformers) greedy agreement on the tiny checkpoint
  4. engine throughput, graphs on and enforce_eager=True, on nano-vllm's bench shape: 256 requests, prompt
     and output lengths uniform in 100..1024, random token ids, ignore_eos
  5. transformers continuous batching on the same model and (a deterministic subset of the) workload
The full log goes to $OUT/gpu_check.log (results/gpu_check.log without OUT), the figures to gpu_check.json.
Nothing here needs the network.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import pathlib
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

REPO = pathlib.Path(__file__).resolve().parents[1]

# Makes `nanovllm_tp.launch/.workers/.scheduler` importable in a child even when the package is not installed:
# setup.cfg maps them to top-level folders, so a bare checkout only has nanovllm_tp/ itself.
BOOT = """
import os, sys
try:
    import nanovllm_tp.workers, nanovllm_tp.launch, nanovllm_tp.scheduler
except ImportError:
    root = os.environ.get("NVTP_REPO") or os.getcwd()
    if root not in sys.path:
        sys.path.insert(0, root)
    import nanovllm_tp
    if root not in list(nanovllm_tp.__path__):
        nanovllm_tp.__path__.append(root)
"""

# Qwen3-0.6B's shape (random weights); the tokenizer stays the tiny BPE, prompts are token ids.
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=4096, torch_dtype="bfloat16")
SMOKE_BENCH = dict(vocab_size=4096, torch_dtype="float32")   # vocab larger than the tokenizer's 2003, as above

# bf16 vs fp32 last-position logits, max|diff| / std(reference); see tests/gpu/test_cuda_path.py for the why.
BF16_LOGIT_REL_TOL = 0.25


# =============================================================================================== shared bits

def now() -> str:
    return datetime.datetime.now().strftime("%H:%M:%S")


def progress(msg: str) -> None:
    """A progress line: children prefix it with @@ so the parent echoes it to the console."""
    print(f"@@ [{now()}] {msg}", flush=True)


def workload(n: int, lo: int, hi: int, seed: int = 0, max_token_id: int = 10000):
    """nano-vllm's bench.py shape: prompt ids in [0, max_token_id], prompt and output lengths in [lo, hi]."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outputs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outputs


def model_vocab(model_dir) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


class Results:
    """A child's figures, rewritten to disk after every update so a killed step still leaves what it had."""

    def __init__(self, path: str | None):
        self.path, self.data = path, {}

    def update(self, **kw) -> None:
        self.data.update(kw)
        if self.path:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1, default=str)
            os.replace(tmp, self.path)


# =============================================================================================== child steps

def _device_facts() -> dict:
    import torch
    facts = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
        facts["gpu_total_gib"] = round(torch.cuda.mem_get_info()[1] / 2**30, 1)
    return facts


def _engine_facts(llm) -> dict:
    runner = llm.engine.runner
    return {"backend": runner.backend.name, "describe": runner.describe(),
            "graph_sizes": None if runner.graphs is None else sorted(runner.graphs.graphs),
            "num_kv_blocks": runner.num_kv_blocks, "block_size": runner.block_size}


def drive(llm, prompts, max_tokens, deadline: float, temperature: float = 0.0) -> dict:
    """Run requests through the engine step by step (what LLM.generate does, minus tqdm), stopping at
    the deadline. Throughput = generated tokens / wall time; with ignore_eos that is the requested tokens."""
    import torch

    from nanovllm_tp.scheduler import Sequence
    engine = llm.engine
    base = getattr(drive, "next_id", 50_000_000)
    seqs = [Sequence(base + i, p, temperature=temperature, max_tokens=n, ignore_eos=True, seed=i)
            for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    drive.next_id = base + len(seqs)
    for s in seqs:
        engine.add(s)
    steps, partial = 0, False
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if time.time() > deadline:
            partial = True
            break
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generated = sum(s.num_completion_tokens for s in seqs)
    if partial:
        engine.scheduler.abort_all()
    return {"requests": len(seqs), "prompt_tokens": sum(map(len, prompts)), "requested_tokens": sum(max_tokens),
            "generated_tokens": generated, "seconds": round(seconds, 3), "steps": steps,
            "tok_s": round(generated / seconds, 1) if seconds > 0 else 0.0, "partial": partial,
            "finished": sum(s.is_finished for s in seqs)}


def step_equal(args, res: Results) -> bool:
    """Eager vs CUDA graphs, same config, greedy: identical tokens expected."""
    import torch

    from nanovllm_tp import LLM, SamplingParams
    res.update(**_device_facts())
    n = 16
    prompts, _ = workload(n, 16, 96 if args.smoke else 512, seed=1,
                          max_token_id=min(10000, model_vocab(args.model) - 1))
    # 64 tokens for the first, then 3 fewer each: the decode batch shrinks 16 -> 1 through every graph size
    max_tokens = [(16 if args.smoke else 64) - (1 if args.smoke else 3) * i for i in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    dtype = "float32" if args.smoke else "bfloat16"
    runs = {}
    for eager in (True, False):
        t0 = time.perf_counter()
        llm = LLM(args.model, dtype=dtype, max_num_seqs=16, max_model_len=1024, kvcache_block_size=16,
                  kv_cache_memory=(256 << 20) if args.smoke else (8 << 30), enforce_eager=eager)
        try:
            facts = _engine_facts(llm)
            build = time.perf_counter() - t0
            t0 = time.perf_counter()
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            runs["eager" if eager else "graphs"] = tokens
            res.update(**{("eager" if eager else "graphs"): {**facts, "build_s": round(build, 2),
                                                               "generate_s": round(time.perf_counter() - t0, 2)}})
            progress(f"equal: {'eager' if eager else 'graphs'} done ({facts['describe']})")
        finally:
            llm.close()     # frees weights, KV cache and graph pools on the GPU
    diffs = {i: first_diff(a, b) for i, (a, b) in enumerate(zip(runs["eager"], runs["graphs"])) if a != b}
    identical = n - len(diffs)
    graphs_on = res.data["graphs"]["graph_sizes"] is not None
    verdict = "PASS" if not diffs else ("WARN" if len(diffs) <= 2 and min(diffs.values()) >= 8 else "FAIL")
    summary = f"{identical}/{n} identical" + (f", diverge at {diffs}" if diffs else "")
    if not graphs_on and torch.cuda.is_available():
        verdict, summary = "FAIL", summary + " (no graphs were captured)"
    elif not graphs_on:
        summary += " (CPU: no graphs, eager both times)"
    res.update(identical=identical, prompts=n, divergence=diffs, verdict=verdict, summary=summary)
    return verdict != "FAIL"


def step_ref(args, res: Results) -> bool:
    """bf16 engine (GPU, graphs on) vs transformers fp32 on CPU, greedy, on the tiny checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from nanovllm_tp import LLM, SamplingParams
    from nanovllm_tp.launch.make_tiny import hf_greedy
    from nanovllm_tp.scheduler import Sequence
    res.update(**_device_facts())
    n, steps = 16, 32
    rng = random.Random(5)
    prompts = [[rng.randrange(2003) for _ in range(rng.randint(4, 300))] for _ in range(n)]
    llm = LLM(args.tiny, dtype="bfloat16", max_num_seqs=16, max_model_len=512, kvcache_block_size=16,
              kv_cache_memory=256 << 20)
    try:
        res.update(engine=_engine_facts(llm))
        engine = llm.engine            # last-position prefill logits of all prompts, one step
        for i, p in enumerate(prompts):
            engine.add(Sequence(90_000_000 + i, p, temperature=0.0, max_tokens=1, ignore_eos=True))
        plan = engine.scheduler.schedule()
        try:
            logits = engine.runner.execute(plan).float().cpu()
        finally:
            engine.scheduler.abort_all()
        got = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), use_tqdm=False)]
    finally:
        llm.close()     # frees weights, KV cache and graph pools on the GPU
    progress("ref: engine done, transformers fp32 reference on CPU")
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    hf = AutoModelForCausalLM.from_pretrained(args.tiny, dtype=torch.float32).eval()
    rel, prefix, full, first = [], [], 0, 0
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref_logits = hf(torch.tensor([p])).logits[0, -1].float()
        rel.append(((logits[i] - ref_logits).abs().max() / ref_logits.std()).item())
        want = hf_greedy(hf, p, steps)
        k = first_diff(got[i], want)
        k = steps if k is None else k
        prefix.append(k)
        full += k == steps
        first += got[i][0] == want[0]
    ok = max(rel) < BF16_LOGIT_REL_TOL and first >= n - n // 8
    summary = (f"full {full}/{n}, prefix {sum(prefix) / n:.1f}/{steps}, 1st tok {first}/{n}, "
               f"logit err {max(rel):.3f}")
    res.update(full_match=full, prompts=n, steps=steps, mean_prefix=sum(prefix) / n, prefixes=prefix,
               first_token_agree=first, logit_rel_err=[round(r, 4) for r in rel], logit_rel_tol=BF16_LOGIT_REL_TOL,
               verdict="PASS" if ok else "FAIL", summary=summary)
    return ok


def step_tput(args, res: Results) -> bool:
    """Engine throughput on the bench workload; graphs on, or enforce_eager=True with --eager."""
    from nanovllm_tp import LLM, SamplingParams
    res.update(**_device_facts())
    prompts, outs = workload(args.requests, args.min_len, args.max_len, seed=0,
                             max_token_id=min(10000, model_vocab(args.model) - 1))
    kwargs = dict(dtype="float32" if args.smoke else "bfloat16", enforce_eager=args.eager,
                  enable_prefix_caching=False)      # random prompts share nothing; no hits across re-runs
    if args.smoke:
        kwargs.update(kv_cache_memory=256 << 20, max_model_len=1024)
    t0 = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    try:
        res.update(engine=_engine_facts(llm), build_s=round(time.perf_counter() - t0, 2), mode=
                   "eager" if args.eager else "graphs")
        progress(f"tput: engine ready in {time.perf_counter() - t0:.1f}s: {llm.engine.runner.describe()}")
        t0 = time.perf_counter()       # warm-up: a few short requests (Triton compiles, allocator, cuBLAS)
        llm.generate([[1, 2, 3] * 10, list(range(100)), [7] * 300], [SamplingParams(temperature=0, max_tokens=m,
                     ignore_eos=True) for m in (8, 40, 20)], use_tqdm=False)
        res.update(warmup_s=round(time.perf_counter() - t0, 2))
        sub_n = min(args.subset, args.requests)
        # graphs: all requests first (the headline figure), then the subset transformers also runs;
        # eager (slower): the subset first, so graphs vs eager compares at least on that
        order = ["subset", "full"] if args.eager else ["full", "subset"]
        for part in order:
            n = sub_n if part == "subset" else args.requests
            if part == "subset" and sub_n >= args.requests:
                continue
            done = res.data.get("full")
            if part == "subset" and done:          # the subset after the full run: only if it fits
                est = done["seconds"] * sum(outs[:n]) / max(1, done["generated_tokens"]) * 2 + 5
                if done["partial"] or time.time() + est > args.deadline:
                    progress(f"tput: no time for the first-{n} run (needs ~{est:.0f}s)")
                    continue
            figures = drive(llm, prompts[:n], outs[:n], args.deadline)
            res.update(**{part: figures})
            progress(f"tput: {n} requests: {figures['tok_s']} tok/s in {figures['seconds']}s"
                     + (" (PARTIAL)" if figures["partial"] else ""))
    finally:
        llm.close()     # frees weights, KV cache and graph pools on the GPU
    runs = [r for r in (res.data.get("full"), res.data.get("subset")) if r]
    return bool(runs) and not any(r["partial"] for r in runs)


def step_hf(args, res: Results) -> bool:
    """transformers continuous batching on the same model and workload (a subset: see --hf-requests)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    res.update(**_device_facts(), transformers=transformers.__version__)
    prompts, outs = workload(args.requests, args.min_len, args.max_len, seed=0,
                             max_token_id=min(10000, model_vocab(args.model) - 1))
    n = min(args.hf_requests, args.requests)
    prompts, outs = prompts[:n], outs[:n]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    res.update(load_s=round(time.perf_counter() - t0, 2), requests=n, requested_tokens=sum(outs),
               attn_implementation=getattr(model.config, "_attn_implementation", None))
    progress(f"hf: model loaded in {time.perf_counter() - t0:.1f}s, {n} requests")
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(outs), eos_token_id=-1, pad_token_id=0)
    try:
        out = _hf_per_request(model, gen, prompts, outs, args, res)
    except Exception as exc:     # API drift between transformers versions: fall back to one max_new_tokens
        res.update(per_request_error=f"{type(exc).__name__}: {exc}", per_request_trace=traceback.format_exc())
        if time.time() > args.deadline - 20:
            raise
        progress(f"hf: per-request continuous batching failed ({type(exc).__name__}: {exc}); "
                 "falling back to generate_batch")
        out = _hf_generate_batch(model, prompts, outs, args, res)
    res.update(**out)
    return not out.get("partial", False)


def _hf_per_request(model, gen, prompts, outs, args, res) -> dict:
    init = model.init_continuous_batching
    kwargs = {"generation_config": gen}
    params = inspect.signature(init).parameters
    if "workload_hints" in params:
        try:
            from transformers.generation.continuous_batching.utils import WorkloadHints
            kwargs["workload_hints"] = WorkloadHints(max_prompt_length=max(map(len, prompts)),
                                                     max_generated_length=max(outs), num_requests=len(prompts))
        except Exception:
            pass
    if args.smoke:      # CPU: size the cache by hand, there is no free GPU memory to read
        try:
            from transformers import ContinuousBatchingConfig
            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=512)
        except Exception:
            pass
    manager = init(**{k: v for k, v in kwargs.items() if k in params})
    add_params = inspect.signature(manager.add_request).parameters
    if "max_new_tokens" not in add_params:
        raise TypeError("add_request has no max_new_tokens in this transformers")
    t0 = time.perf_counter()
    if hasattr(manager, "warmup") and not args.smoke:
        try:
            manager.warmup()
        except Exception as exc:
            res.update(warmup_error=f"{type(exc).__name__}: {exc}")
    res.update(warmup_s=round(time.perf_counter() - t0, 2))
    progress(f"hf: continuous batching warm-up {time.perf_counter() - t0:.1f}s")
    manager.start()
    results, wanted, partial = {}, {}, False
    try:
        start = time.perf_counter()
        for i, (p, m) in enumerate(zip(prompts, outs)):
            extra = {"eos_token_id": -1} if "eos_token_id" in add_params else {}
            rid = manager.add_request(p, request_id=f"r{i}", max_new_tokens=m, **extra)
            wanted[rid if rid is not None else f"r{i}"] = m
        while len(results) < len(wanted):
            if time.time() > args.deadline:
                partial = True
                break
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
            elif r is None and not manager.is_running():
                raise RuntimeError(f"the generation thread stopped with {len(results)}/{len(wanted)} results")
        seconds = time.perf_counter() - start
    finally:
        try:
            stop = {"hard_stop": True} if partial and "hard_stop" in inspect.signature(manager.stop).parameters else {}
            manager.stop(block=True, timeout=10, **stop)
        except Exception:
            pass
    errors = {k: r.error for k, r in results.items() if getattr(r, "error", None)}
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {next(iter(errors.values()))}")
    if not results and not partial:
        raise RuntimeError("no request finished")
    lengths_ok = sum(len(r.generated_tokens) == wanted[k] for k, r in results.items())
    generated = sum(len(r.generated_tokens) for r in results.values())
    return {"path": "per-request (init_continuous_batching + add_request)", "seconds": round(seconds, 3),
            "finished": len(results), "generated_tokens": generated, "lengths_as_requested": lengths_ok,
            "tok_s": round(generated / seconds, 1) if generated else None, "partial": partial}


def _hf_generate_batch(model, prompts, outs, args, res) -> dict:
    from transformers import GenerationConfig
    mean = round(sum(outs) / len(outs))
    gen = GenerationConfig(do_sample=False, max_new_tokens=mean, eos_token_id=-1, pad_token_id=0)
    start = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=gen)
    seconds = time.perf_counter() - start
    generated = sum(len(r.generated_tokens) for r in out.values())
    return {"path": f"generate_batch fallback, one max_new_tokens={mean} (the mean)", "seconds": round(seconds, 3),
            "finished": len(out), "generated_tokens": generated, "tok_s": round(generated / seconds, 1),
            "partial": False}


CHILD_STEPS = {"equal": step_equal, "ref": step_ref, "tput": step_tput, "hf": step_hf}


def child_main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--step", required=True, choices=sorted(CHILD_STEPS))
    p.add_argument("--json", required=True)
    p.add_argument("--model")
    p.add_argument("--tiny")
    p.add_argument("--deadline", type=float, default=time.time() + 600)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--subset", type=int, default=64)
    p.add_argument("--hf-requests", type=int, default=64)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    args = p.parse_args(argv if argv is not None else sys.argv[1:])
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    res = Results(args.json)
    res.update(step=args.step, started=time.time())
    try:
        ok = CHILD_STEPS[args.step](args, res)
        res.update(ok=bool(ok), ended=time.time())
    except BaseException as exc:
        res.update(ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)     # don't wait on leftover non-daemon threads (transformers' batching thread)


# =============================================================================================== parent

class Log:
    def __init__(self, path: pathlib.Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.f, self.lock, self.t0 = path, open(path, "w", buffering=1), threading.Lock(), time.time()

    def write(self, text: str) -> None:
        with self.lock:
            self.f.write(text if text.endswith("\n") else text + "\n")

    def say(self, msg: str) -> None:
        line = f"[{now()} +{time.time() - self.t0:6.1f}s] {msg}"
        self.write(line)
        print(line, flush=True)


def child_env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", NVTP_REPO=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


_running: set = set()      # children's process groups, stopped if this process is told to stop


def _stop_children(signum=None, frame=None) -> None:
    for pid in list(_running):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if signum is not None:
        sys.exit(128 + signum)


def run_child(log: Log, name: str, cmd: list[str], timeout: float) -> tuple[int | None, float]:
    """Run cmd in its own session; its output goes to the log (@@ lines also to the console).
    Returns (exit code or None on timeout, seconds)."""
    log.write(f"\n===== {name}: {' '.join(c if len(c) < 200 else '<code>' for c in cmd)} (timeout {timeout:.0f}s)")
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", bufsize=1, start_new_session=True)
    _running.add(proc.pid)

    def pump():
        for line in proc.stdout:
            log.write(line.rstrip("\n"))
            if line.startswith("@@ "):
                print(f"    {line[3:].rstrip()}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
        log.say(f"{name}: over its {timeout:.0f}s cap, stopping it")
        for sig, wait in ((signal.SIGTERM, 8), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    reader.join(timeout=5)
    _running.discard(proc.pid)
    return rc, time.time() - start


def python_cmd(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", BOOT + code, *args]


def make_models(workdir: pathlib.Path, smoke: bool, log: Log):
    """The tiny checkpoint now (seconds); the bench checkpoint in a background process (CPU, ~10-20 s)."""
    from nanovllm_tp.launch.make_tiny import make_tiny
    tiny = workdir / "tiny"
    make_tiny(tiny)
    bench = workdir / ("bench-smoke" if smoke else "qwen3-0.6b-shape")
    overrides = SMOKE_BENCH if smoke else QWEN3_06B
    code = f"\nfrom nanovllm_tp.launch.make_tiny import make_tiny\nmake_tiny({str(bench)!r}, **{overrides!r})\n"
    log.write(f"making {bench} with {overrides}")
    proc = subprocess.Popen(python_cmd(code), cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    _running.add(proc.pid)
    return tiny, bench, proc


def versions() -> dict:
    info = {"python": platform.python_version(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node()}
    for mod in ("torch", "transformers", "triton", "flash_attn", "zmq", "msgpack", "pytest"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as exc:
            info[mod] = None if isinstance(exc, ImportError) else f"error: {exc}"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except Exception as exc:
        info["nvidia_smi"] = f"unavailable ({type(exc).__name__})"
    return info


def pytest_summary(log_path: pathlib.Path, since: int) -> str:
    import re
    text = log_path.read_text(errors="replace")[since:]
    counts = {}
    for line in text.splitlines()[::-1]:
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|warnings?)", line)
        if found and ("in " in line and "s" in line):
            counts = {k: int(v) for v, k in found}
            break
    return ", ".join(f"{v} {k}" for k, v in counts.items()) or "no summary line"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny models, few requests")
    parser.add_argument("--budget", type=float, default=None, help="seconds for everything (default 450; smoke 420)")
    parser.add_argument("--out", default=None, help="folder for gpu_check.log/.json (default $OUT or results/)")
    parser.add_argument("--requests", type=int, default=None, help="throughput requests (default 256; smoke 12)")
    parser.add_argument("--hf-requests", type=int, default=None, help="requests given to transformers (default 64)")
    parser.add_argument("--skip", default="", help="comma-separated steps to skip: pytest,equal,ref,tput,eager,hf")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    args = parser.parse_args(argv)
    smoke = args.smoke
    budget = args.budget or (420.0 if smoke else 450.0)
    out_dir = pathlib.Path(args.out or os.environ.get("OUT") or REPO / "results")
    log = Log(out_dir / "gpu_check.log")
    json_path = out_dir / "gpu_check.json"
    t_start = time.time()
    deadline = t_start + budget
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    requests = args.requests or (12 if smoke else 256)
    hf_requests = args.hf_requests or (4 if smoke else 64)
    lens = ("8", "48") if smoke else ("100", "1024")

    signal.signal(signal.SIGTERM, _stop_children)
    import atexit
    atexit.register(_stop_children)
    info = versions()
    log.say(f"gpu_check {'--smoke ' if smoke else ''}starts: budget {budget:.0f}s, log {log.path}")
    log.write(json.dumps(info, indent=1))
    import torch  # no CUDA context in this process: the children own the GPU
    cuda = torch.cuda.is_available()
    if not cuda and not smoke:
        log.say("torch sees no CUDA device: GPU steps will be skipped (use --smoke on a CPU machine)")

    rows, figures, childres = [], {}, {}
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="nvtp_gpu_check_"))

    def add_row(step, result, seconds, status):
        rows.append({"step": step, "result": result, "seconds": round(seconds, 1), "status": status})
        log.say(f"{step}: {result} ({seconds:.1f}s)")
        save()

    def save():
        doc = {"info": info, "smoke": smoke, "budget_s": budget, "elapsed_s": round(time.time() - t_start, 1),
               "steps": rows, "figures": figures, "children": childres}
        json_path.write_text(json.dumps(doc, indent=1, default=str))

    # ---- models
    t0 = time.time()
    tiny = bench = maker = None
    try:
        tiny, bench, maker = make_models(workdir, smoke, log)
        add_row("make tiny checkpoint", "PASS", time.time() - t0, "PASS")
    except Exception as exc:
        log.write(traceback.format_exc())
        add_row("make tiny checkpoint", f"FAIL {type(exc).__name__}: {exc}", time.time() - t0, "FAIL")

    bench_state = {"ok": None, "t0": time.time()}      # made in the background while pytest runs

    def bench_ready() -> bool:
        nonlocal maker
        if maker is None:
            return bool(bench_state["ok"])
        try:
            out, _ = maker.communicate(timeout=max(5.0, min(120.0, deadline - time.time() - 60)))
        except subprocess.TimeoutExpired:
            os.killpg(maker.pid, signal.SIGKILL)
            out, _ = maker.communicate()
        log.write(out or "")
        _running.discard(maker.pid)
        ok = maker.returncode == 0
        add_row("make bench checkpoint (background)" + ("" if smoke else ", Qwen3-0.6B shape"), "PASS" if ok else
                f"FAIL rc={maker.returncode}", time.time() - bench_state["t0"], "PASS" if ok else "FAIL")
        maker = None
        bench_state["ok"] = ok
        return ok

    # ---- steps: (key, row name, min seconds, cap seconds, needs)
    plan = [("pytest", "pytest tests/gpu", 30, 170, "tiny"),
            ("equal", "eager vs graphs tokens" + ("" if smoke else " (0.6B, bf16)"), 25, 100, "bench"),
            ("ref", "bf16 GPU vs fp32 CPU (tiny)", 20, 70, "tiny"),
            ("tput", f"tok/s, graphs ({requests} req)", 40, 130, "bench"),
            ("eager", f"tok/s, enforce_eager ({requests} req)", 30, 110, "bench"),
            ("hf", f"tok/s, transformers CB ({hf_requests} req)", 40, 120, "bench")]
    gpu_only = {"pytest": False, "equal": True, "ref": True, "tput": True, "eager": True, "hf": True}
    for index, (key, name, min_s, cap_s, needs) in enumerate(plan):
        if key in skip:
            add_row(name, "SKIP (--skip)", 0, "SKIP")
            continue
        if gpu_only[key] and not cuda and not smoke:
            add_row(name, "SKIP (no CUDA)", 0, "SKIP")
            continue
        if needs == "bench" and not bench_ready():
            add_row(name, "SKIP (no bench checkpoint)", 0, "SKIP")
            continue
        if needs == "tiny" and tiny is None:
            add_row(name, "SKIP (no tiny checkpoint)", 0, "SKIP")
            continue
        reserve = sum(p[2] for p in plan[index + 1:] if p[0] not in skip)
        timeout = min(cap_s, deadline - time.time() - reserve)
        if timeout < min_s:
            add_row(name, f"SKIP (no time left: {timeout:.0f}s < {min_s}s)", 0, "SKIP")
            continue
        if key == "pytest" and info.get("pytest") is None:
            add_row(name, "SKIP (pytest is not installed)", 0, "SKIP")
            continue
        log.say(f"step {key}: starting, cap {timeout:.0f}s")
        if key == "pytest":
            since = log.path.stat().st_size
            code = ("\nimport sys, pytest\nsys.exit(pytest.main(['tests/gpu', '-q', '-rsfE', '-p', "
                    "'no:cacheprovider']))\n")
            rc, secs = run_child(log, key, python_cmd(code), timeout)
            log.f.flush()
            summary = pytest_summary(log.path, since)
            status = "PASS" if rc == 0 else ("TIMEOUT" if rc is None else "FAIL")
            figures["pytest"] = {"rc": rc, "summary": summary}
            add_row(name, f"{status} ({summary})", secs, status if status != "TIMEOUT" else "FAIL")
            continue
        child_json = str(workdir / f"{key}.json")
        step = {"eager": "tput"}.get(key, key)
        cmd = ["--step", step, "--json", child_json, "--tiny", str(tiny), "--model", str(bench),
               "--deadline", f"{time.time() + timeout - 12:.0f}", "--requests", str(requests),
               "--hf-requests", str(hf_requests), "--subset", str(hf_requests),
               "--min-len", lens[0], "--max-len", lens[1]]
        cmd += ["--smoke"] if smoke else []
        cmd += ["--eager"] if key == "eager" else []
        code = "\nfrom nanovllm_tp.launch.gpu_check import child_main\nchild_main()\n"
        rc, secs = run_child(log, key, python_cmd(code, *cmd), timeout)
        try:
            data = json.loads(pathlib.Path(child_json).read_text())
        except Exception:
            data = {}
        data.pop("trace", None) if rc == 0 else None
        childres[key] = data
        add_row(name, describe_child(key, rc, data), secs, status_of(key, rc, data))
        if data.get("gpu"):
            info["gpu"] = data["gpu"]
        if (data.get("engine") or {}).get("backend"):
            info["attention_backend"] = data["engine"]["backend"]

    # ---- derived figures
    def tok_s(key, part):
        d = childres.get(key, {}).get(part) or {}
        return d.get("tok_s") if d and not d.get("partial") else None

    g_full, e_full, g_sub = tok_s("tput", "full"), tok_s("eager", "full"), tok_s("tput", "subset")
    hf = childres.get("hf", {})
    hf_tps = hf.get("tok_s") or None        # a partial run counts finished requests only: a lower bound
    e_sub = tok_s("eager", "subset")
    if g_full and e_full:
        figures["graph_speedup"] = round(g_full / e_full, 2)
        add_row("graph speed-up (graphs / eager)", f"{figures['graph_speedup']}x", 0, "INFO")
    elif g_sub and e_sub:
        figures["graph_speedup"] = round(g_sub / e_sub, 2)
        add_row(f"graph speed-up (graphs / eager, first {hf_requests} req)", f"{figures['graph_speedup']}x", 0,
                "INFO")
    if hf_tps:
        base = g_sub if g_sub and hf.get("requests", 0) < requests else g_full
        if base:
            figures["engine_over_hf"] = round(base / hf_tps, 2)
            same = "same subset" if base is g_sub else "engine on all requests"
            same += ", HF partial: upper bound" if hf.get("partial") else ""
            add_row(f"engine / transformers ({same})", f"{figures['engine_over_hf']}x", 0, "INFO")
    figures.update(tput_graphs=g_full, tput_eager=e_full, tput_graphs_subset=g_sub, tput_eager_subset=e_sub,
                   tput_hf=hf_tps)
    save()

    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.time() - t_start
    log.say(f"done in {elapsed:.0f}s; figures in {json_path}")
    table = render_table(info, rows, elapsed, smoke)
    log.write(table)
    print(table, flush=True)
    return 0 if all(r["status"] in ("PASS", "INFO", "SKIP", "WARN") for r in rows) else 1


def status_of(key, rc, data) -> str:
    if rc is None and not data.get("ok"):
        return "FAIL"
    if key in ("equal", "ref"):
        return data.get("verdict") or ("PASS" if rc == 0 and data.get("ok") else "FAIL")
    return "PASS" if rc == 0 and data.get("ok") else ("WARN" if data.get("tok_s") or data.get("full") else "FAIL")


def describe_child(key, rc, data) -> str:
    err = data.get("error")
    prefix = "TIMEOUT " if rc is None else ""
    if key in ("equal", "ref") and data.get("summary"):
        return f"{data.get('verdict', 'FAIL')} {prefix}{data['summary']}".strip()
    if key in ("tput", "eager") and (data.get("full") or data.get("subset")):
        parts = []
        for part in ("full", "subset"):
            run = data.get(part)
            if run:
                text = f"{run['tok_s']:.0f} tok/s"
                text += f" ({run['generated_tokens']} tok, {run['seconds']:.1f}s)" if part == "full" else \
                    f" on the first {run['requests']}"
                if run.get("partial"):
                    text += f" PARTIAL {run['finished']}/{run['requests']} done"
                parts.append(text)
        return prefix + "; ".join(parts)
    if key == "hf" and data.get("tok_s"):
        text = f"{data['tok_s']:.0f} tok/s ({data['finished']}/{data['requests']} req, {data['seconds']:.1f}s)"
        if "fallback" in data.get("path", ""):
            text += " [generate_batch fallback, uniform max_new_tokens]"
        elif data.get("lengths_as_requested") is not None and data["lengths_as_requested"] != data["finished"]:
            text += f" [{data['lengths_as_requested']} with the requested length]"
        if data.get("partial"):
            text += " PARTIAL"
        return prefix + text
    if key == "hf" and data.get("partial"):
        done = f"{data.get('finished', 0)}/{data.get('requests')}"
        return f"{prefix}PARTIAL: {done} requests done in {data.get('seconds')}s"
    if err:
        return f"FAIL {prefix}{err[:160]}"
    return f"FAIL {prefix}rc={rc}"


def render_table(info, rows, elapsed, smoke) -> str:
    head = [f"nanovllm_tp gpu_check{' --smoke (CPU)' if smoke else ''}   {info.get('date')}   total {elapsed:.0f}s",
            f"GPU: {info.get('gpu') or info.get('nvidia_smi') or 'none'}",
            f"torch {info.get('torch')}, transformers {info.get('transformers')}, triton {info.get('triton')}, "
            f"flash-attn {info.get('flash_attn') or 'not installed'}, python {info.get('python')}",
            f"attention backend: {info.get('attention_backend', 'unknown')}"]
    width = max([len(r["step"]) for r in rows] + [4])
    res_w = min(100, max([len(r["result"]) for r in rows] + [6]))
    lines = ["", "=" * (width + res_w + 14), *head, "-" * (width + res_w + 14),
             f"{'step':<{width}}  {'result':<{res_w}}  {'seconds':>8}"]
    for r in rows:
        result = r["result"] if len(r["result"]) <= res_w else r["result"][:res_w - 3] + "..."
        lines.append(f"{r['step']:<{width}}  {result:<{res_w}}  {r['seconds']:>8.1f}")
    lines.append("=" * (width + res_w + 14))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
