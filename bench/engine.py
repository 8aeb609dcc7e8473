"""The engine side of the offline benchmarks (bench, bench_vllm, gpu_check, bench_latency, bench_serve): the
workload's sampling parameters, the warm-up, one timed generate() and the medians of repeated runs."""
import time

from nanovllm_tp.bench import common as bc


def sampling_params(workload: bc.Workload, temperature: float, mixed: bool = False):
    """Every row at `temperature`; with mixed, every other row samples with the full set of knobs instead."""
    from nanovllm_tp import SamplingParams
    knobs = dict(temperature=0.8, top_p=0.9, top_k=50, min_p=0.02, repetition_penalty=1.1, presence_penalty=0.3,
                 frequency_penalty=0.2, logprobs=5)
    return [SamplingParams(**(knobs if mixed and i % 2 else {"temperature": temperature}), seed=i, max_tokens=m,
                           ignore_eos=True) for i, m in enumerate(workload.output_lens)]


def warm_up_engine(llm, vocab_size: int, seed: int, temperature: float) -> float:
    from nanovllm_tp import SamplingParams
    prompts, outs = bc.warmup_prompts(vocab_size, seed)
    t0 = time.perf_counter()
    llm.generate(prompts, [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True) for m in outs],
                 use_tqdm=False)
    return time.perf_counter() - t0


def run_engine(llm, workload: bc.Workload, prompts, temperature: float, mixed: bool = False,
               progress=False) -> dict:
    """One timed generate() of the workload; `progress`: its use_tqdm (bench/progress.py's lines, or False)."""
    params = sampling_params(workload, temperature, mixed)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    seconds = time.perf_counter() - t0
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    tpot = bc.median(o.metrics.tpot for o in outputs if o.metrics is not None)    # None where no request has one
    return {"seconds": seconds, "tok_s": workload.requested_output_tokens / seconds,
            "lengths_ok": produced == workload.output_lens, "generated_tokens": sum(produced),
            "tpot_ms": None if tpot is None else tpot * 1e3}


def summarize_runs(runs: list[dict]) -> dict:
    return {"tok_s": bc.median(r["tok_s"] for r in runs), "seconds": bc.median(r["seconds"] for r in runs),
            "tok_s_runs": [round(r["tok_s"], 2) for r in runs], "seconds_runs": [round(r["seconds"], 4) for r in runs],
            "tpot_ms": bc.median(r.get("tpot_ms") for r in runs),
            "lengths_ok": all(r["lengths_ok"] for r in runs)}
