"""Offline throughput on nano-vllm's bench workload, optionally against transformers on the same model.

    python -m nanovllm_tp.launch.bench                              # tiny checkpoint, 64 requests, 16..256
    python -m nanovllm_tp.launch.bench --compare hf --repeats 3     # + transformers generate and generate_batch
    python -m nanovllm_tp.launch.bench --preset small --tp 2        # compute-bound random-weight preset, 2 ranks
    python -m nanovllm_tp.launch.bench --sampling mixed --repeats 5 # sampling knobs on half the rows vs greedy
    python -m nanovllm_tp.launch.bench --model DIR --compare vllm --peer-python VENV/bin/python  # see bench_vllm.py
    ./torchrun.sh 2 -m nanovllm_tp.launch.bench --tp 2

N requests with random prompt ids; prompt and output lengths uniform in --prompt-len / --output-len; every
request ignores EOS, so it yields exactly its requested tokens. Throughput = requested output tokens / wall time
of one generate() call (after a small warm-up). With --repeats K every measurement runs K times, the engines
interleaved (engine, transformers, engine, ...) so load from other processes hits them alike, and medians are
reported. Each repeat redraws the prompt ids (same lengths), so the prefix cache cannot hit across repeats.

--sampling mixed: each repeat also runs the workload with half the rows sampling with top-p, top-k, min-p,
repetition / presence / frequency penalties and 5 logprobs per token (the other half as --temperature says),
interleaved with the plain run, and reports mixed / plain throughput.

--compare hf, in this process, on the same checkpoint, dtype and device as the engine, same prompts:
  hf generate: model.generate on static batches: requests sorted by requested output length (then prompt length),
      left-padded with an attention mask, min_new_tokens = max_new_tokens = the batch's largest requested output;
      tried at every --hf-batch-sizes, the fastest (median) is reported; only requested tokens are counted.
  hf continuous batching: transformers' continuous batching manager (the engine behind generate_batch), one
      add_request per request with its own max_new_tokens and EOS disabled.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

from nanovllm_tp.launch import bench_common as bc
from nanovllm_tp.launch.bench_engine import run_engine, summarize_runs, warm_up_engine

NAME = "bench"


def build_parser() -> argparse.ArgumentParser:
    from nanovllm_tp.launch.generate import add_engine_args
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    bc.add_workload_args(parser)
    parser.add_argument("--repeats", type=int, default=1, help="runs per measurement; medians are reported")
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up generate")
    parser.add_argument("--sampling", choices=["plain", "mixed"], default="plain",
                        help="mixed: also run with sampling knobs and logprobs on half the rows, same run")
    g = parser.add_argument_group("comparison with transformers")
    g.add_argument("--compare", choices=["hf", "vllm"],
                   help="also run transformers (hf), or vLLM from --peer-python, on the same model and workload")
    g.add_argument("--hf-modes", nargs="+", choices=["generate", "cb"], default=["generate", "cb"],
                   help="which transformers paths to run (default: both)")
    g.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64],
                   help="static batch sizes tried for model.generate (capped at --num-requests)")
    g.add_argument("--hf-cb-max-batch-tokens", type=int, default=None,
                   help="continuous batching: tokens per step (default: min(512, --max-num-batched-tokens); "
                        "its own 8192 default sizes an sdpa mask of GBs on CPU and is slower there)")
    from nanovllm_tp.launch.bench_vllm import add_peer_args
    add_peer_args(parser)
    bc.add_output_args(parser)
    return parser


# =============================================================================================== engine

# =============================================================================================== transformers

class HFRunner:
    """transformers on the engine's checkpoint, dtype and device."""

    def __init__(self, model_dir: str, dtype, device, temperature: float, seed: int, cb_max_batch_tokens: int):
        import torch
        from transformers import AutoModelForCausalLM
        bc.quiet_transformers()
        self.torch, self.temperature, self.seed = torch, temperature, seed
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device = device
        gc = self.model.generation_config
        eos = gc.eos_token_id if gc.eos_token_id is not None else self.model.config.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        self.pad_id = gc.pad_token_id if gc.pad_token_id is not None else (eos if eos is not None else 0)
        self.cb_max_batch_tokens = cb_max_batch_tokens
        self.attn_implementation = getattr(self.model.config, "_attn_implementation", None)

    def _sampling(self) -> dict:
        if self.temperature > 0:      # plain temperature sampling, like the engine: no top-k / top-p
            return dict(do_sample=True, temperature=self.temperature, top_k=None, top_p=None)
        return dict(do_sample=False, temperature=None, top_k=None, top_p=None)

    # ---- static batches with model.generate ----

    @staticmethod
    def batches(workload: bc.Workload, batch_size: int) -> list[list[int]]:
        order = sorted(range(workload.num_requests),
                       key=lambda i: (workload.output_lens[i], workload.prompt_lens[i]))
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]

    def generate_static(self, workload: bc.Workload, prompts, batch_size: int) -> dict:
        torch = self.torch
        torch.manual_seed(self.seed)
        produced_ok, steps, t0 = True, 0, time.perf_counter()
        with torch.inference_mode():
            for idx in self.batches(workload, batch_size):
                width = max(len(prompts[i]) for i in idx)
                new = max(workload.output_lens[i] for i in idx)
                ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for row, i in enumerate(idx):       # left padding
                    ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                    mask[row, width - len(prompts[i]):] = 1
                out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                          max_new_tokens=new, min_new_tokens=new, pad_token_id=self.pad_id,
                                          **self._sampling())
                produced_ok &= out.shape[1] - width == new
                steps += new
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "tok_s": workload.requested_output_tokens / seconds, "lengths_ok": produced_ok,
                "decode_steps": steps}

    # ---- continuous batching ----

    def cb_config(self, workload: bc.Workload) -> dict:
        page = 256
        blocks = sum(math.ceil((p + o) / page) + 1 for p, o in zip(workload.prompt_lens, workload.output_lens))
        return {"page_size": page, "num_blocks": blocks + 8, "max_batch_tokens": self.cb_max_batch_tokens,
                "allow_block_sharing": False}

    def generate_cb(self, workload: bc.Workload, prompts) -> dict:
        torch = self.torch
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints
        torch.manual_seed(self.seed)
        sampling = {k: v for k, v in self._sampling().items() if v is not None}
        gen = GenerationConfig(max_new_tokens=max(workload.output_lens), eos_token_id=-1, pad_token_id=self.pad_id,
                               **sampling)
        cfg = self.cb_config(workload)
        cb_config = ContinuousBatchingConfig(**cfg, seed=self.seed)
        hints = WorkloadHints(max_prompt_length=max(workload.prompt_lens),
                              max_generated_length=max(workload.output_lens), num_requests=workload.num_requests)
        manager = self.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config,
                                                      workload_hints=hints)
        manager.warmup()            # builds the paged cache (no-op warm-up on CPU): set-up, not timed
        manager.start()
        results = {}
        try:
            t0 = time.perf_counter()
            for i, (p, m) in enumerate(zip(prompts, workload.output_lens)):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1)
            while len(results) < workload.num_requests:
                r = manager.get_result(timeout=1)
                if r is not None and r.is_finished():
                    results[r.request_id] = r
                elif r is None and not manager.is_running():
                    raise RuntimeError(f"transformers' continuous batching thread stopped with "
                                       f"{len(results)}/{workload.num_requests} results")
            seconds = time.perf_counter() - t0
        finally:
            manager.stop(block=True, timeout=30)
            manager.destroy()
        errors = [r.error for r in results.values() if r.error]
        if errors:
            raise RuntimeError(f"transformers' continuous batching failed {len(errors)} requests: {errors[0]}")
        produced = [len(results[f"r{i}"].generated_tokens) for i in range(workload.num_requests)]
        return {"seconds": seconds, "tok_s": workload.requested_output_tokens / seconds,
                "lengths_ok": produced == workload.output_lens}

    def warm_up(self, vocab_size: int, modes) -> float:
        prompts, outs = bc.warmup_prompts(vocab_size, self.seed)
        w = bc.Workload([len(p) for p in prompts], outs, self.seed, vocab_size)
        t0 = time.perf_counter()
        if "generate" in modes:
            self.generate_static(w, prompts, len(prompts))
        if "cb" in modes:
            self.generate_cb(w, prompts)
        return time.perf_counter() - t0


# =============================================================================================== summary

def table(result: dict) -> str:
    f, c, w = result["figures"], result["config"], result["workload"]
    engine = f["engine"]
    rows = [[f"nanovllm_tp TP={c['tp']}", engine["tok_s"], f"{engine['seconds']:.3f}", "1.00"]]
    if "engine_mixed" in f:
        m = f["engine_mixed"]
        rows.append(["nanovllm_tp, mixed sampling", m["tok_s"], f"{m['seconds']:.3f}",
                     f"{1 / f['ratios']['engine_mixed/engine']:.2f}"])
    for key, label in (("hf_generate", "hf generate"), ("hf_continuous", "hf continuous batching")):
        if key in f:
            e = f[key]
            if key == "hf_generate":
                label += f" (bs={e['batch_size']})"
            ratio = f["ratios"].get(f"engine/{key}")
            rows.append([label, e["tok_s"], f"{e['seconds']:.3f}", f"{ratio:.2f}" if ratio else "-"])
    title = (f"bench: {w['num_requests']} requests, prompt {w['prompt_len_min']}..{w['prompt_len_max']}, output "
             f"{w['output_len_min']}..{w['output_len_max']} ({w['requested_output_tokens']} requested tokens), "
             f"{c['model_source']}, T={c['temperature']}, "
             f"median of {c['repeats']}, torch threads {result['environment']['torch_threads']}")
    return bc.format_table(["engine", "output tok/s", "seconds", "engine/this"], rows, title)


def draw(result: dict):
    def _draw(plt):
        f = result["figures"]
        labels, values, lo, hi = [], [], [], []
        for key, label in (("engine", "nanovllm_tp"), ("hf_generate", "hf generate"),
                           ("hf_continuous", "hf CB")):
            if key in f:
                labels.append(label if key != "hf_generate" else f"{label}\nbs={f[key]['batch_size']}")
                values.append(f[key]["tok_s"])
                lo.append(f[key]["tok_s"] - min(f[key]["tok_s_runs"]))
                hi.append(max(f[key]["tok_s_runs"]) - f[key]["tok_s"])
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(labels, values, yerr=[lo, hi], capsize=4, color=["C0", "C1", "C2"][:len(values)])
        ax.set_ylabel("output tokens / s (median, min-max)")
        ax.set_title(f"throughput, {result['workload']['num_requests']} requests")
        return fig
    return _draw


# =============================================================================================== main

def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.compare == "vllm":
        from nanovllm_tp.launch import bench_vllm
        return bench_vllm.main(args)
    if args.compare and "generate" in args.hf_modes and not any(b > 0 for b in args.hf_batch_sizes):
        raise SystemExit("--hf-batch-sizes needs at least one size >= 1")
    bc.apply_threads(args)
    args.model_source = args.model or f"preset {args.preset}"
    args.model = bc.resolve_model(args)
    vocab = bc.model_vocab_size(args.model)
    workload = bc.make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.seed, vocab)
    from nanovllm_tp.launch.generate import build_llm
    t0 = time.perf_counter()
    llm = build_llm(args)            # under torchrun, ranks > 0 serve in here and exit when rank 0 is done
    build_s = time.perf_counter() - t0
    env = bc.environment()
    out_path = bc.pathlib.Path(args.out) if args.out else bc.default_out_path(NAME)
    runner_desc = llm.engine.runner.describe()
    bc.log(args, f"engine ready in {build_s:.1f}s: {runner_desc}")
    extra = {"engine_build_s": build_s}
    hf = None
    try:
        if not args.no_warmup:
            extra["engine_warmup_s"] = warm_up_engine(llm, vocab, args.seed, args.temperature)
        if args.compare == "hf":
            cb_tokens = args.hf_cb_max_batch_tokens or min(512, args.max_num_batched_tokens)
            hf = HFRunner(args.model, llm.engine.dtype, llm.engine.device, args.temperature, args.seed, cb_tokens)
            extra["hf_warmup_s"] = hf.warm_up(vocab, args.hf_modes)
        batch_sizes = sorted({min(b, workload.num_requests) for b in args.hf_batch_sizes if b > 0})
        engine_runs, static_runs, cb_runs, mixed_runs = [], {b: [] for b in batch_sizes}, [], []
        for r in range(args.repeats):
            prompts = workload.prompts(draw=r + 1)
            engine_runs.append(run_engine(llm, workload, prompts, args.temperature))
            bc.log(args, f"[{r + 1}/{args.repeats}] engine: {engine_runs[-1]['tok_s']:.1f} tok/s "
                         f"in {engine_runs[-1]['seconds']:.2f}s")
            if args.sampling == "mixed":      # fresh prompts: no prefix hits from the plain run
                mixed_runs.append(run_engine(llm, workload, workload.prompts(draw=1000 + r), args.temperature, True))
                bc.log(args, f"[{r + 1}/{args.repeats}] engine, mixed sampling: {mixed_runs[-1]['tok_s']:.1f} tok/s")
            if hf is None:
                continue
            if "generate" in args.hf_modes:
                for b in batch_sizes:
                    static_runs[b].append(hf.generate_static(workload, prompts, b))
                    bc.log(args, f"[{r + 1}/{args.repeats}] hf generate bs={b}: "
                                 f"{static_runs[b][-1]['tok_s']:.1f} tok/s")
            if "cb" in args.hf_modes:
                cb_runs.append(hf.generate_cb(workload, prompts))
                bc.log(args, f"[{r + 1}/{args.repeats}] hf continuous batching: {cb_runs[-1]['tok_s']:.1f} tok/s")
    finally:
        llm.close()

    figures = {"engine": {**summarize_runs(engine_runs), "tp": args.tp, "runner": runner_desc},
               "ratios": {}}
    if hf is not None and "generate" in args.hf_modes:
        sweep = {str(b): summarize_runs(runs) for b, runs in static_runs.items()}
        best = max(batch_sizes, key=lambda b: sweep[str(b)]["tok_s"])
        figures["hf_generate"] = {**sweep[str(best)], "batch_size": best, "sweep": sweep,
                                  "choice": "fastest median tok/s over the batch sizes in 'sweep'; requests sorted "
                                            "by (requested output, prompt) length, left-padded, min_new_tokens = "
                                            "max_new_tokens = the batch's largest requested output"}
    if hf is not None and "cb" in args.hf_modes:
        figures["hf_continuous"] = {**summarize_runs(cb_runs), "config": hf.cb_config(workload),
                                    "path": "init_continuous_batching + add_request(max_new_tokens=per request, "
                                            "eos_token_id=-1)"}
    if mixed_runs:
        figures["engine_mixed"] = {**summarize_runs(mixed_runs), "knobs": "odd rows: T=0.8, top_p=0.9, top_k=50, "
                                   "min_p=0.02, repetition 1.1, presence 0.3, frequency 0.2, logprobs=5"}
        figures["ratios"]["engine_mixed/engine"] = bc.median(m["tok_s"] / e["tok_s"]
                                                             for m, e in zip(mixed_runs, engine_runs))
    for key in ("hf_generate", "hf_continuous"):
        if key in figures:
            figures["ratios"][f"engine/{key}"] = figures["engine"]["tok_s"] / figures[key]["tok_s"]
    if hf is not None:
        figures["hf"] = {"attn_implementation": hf.attn_implementation, "dtype": str(llm.engine.dtype),
                         "device": str(llm.engine.device)}
    figures["total_tok_s"] = (workload.prompt_tokens + workload.requested_output_tokens) / figures["engine"]["seconds"]
    result = {"name": NAME, "config": bc.config_dict(args), "workload": workload.describe(),
              "environment": bc.finish_environment(env), "timings": extra, "figures": figures}
    bc.save_result(args, out_path, result, draw)
    if not figures["engine"]["lengths_ok"]:
        print("WARNING: the engine did not produce the requested number of tokens for every request",
              file=sys.stderr)
    print(table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
