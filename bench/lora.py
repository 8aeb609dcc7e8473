"""Multi-LoRA throughput: a batch where every request has its own adapter against the same batch on the base model,
in one engine, interleaved in the same run.

    python -m nanovllm_tp.bench.lora --model SmolLM2.gguf --num-requests 8 --lora-rank 16 --repeats 5

--num-adapters adapters (default: one per request) of rank --lora-rank on every target (q/k/v/o/gate/up/down)
are made with peft (launch/make_lora) in a temporary directory, request i running adapter i mod --num-adapters;
the engine runs with enable_lora and max_loras = --num-adapters, so all are resident after the warm-up (which also
fills the prefix cache for both sides). --lora-dtype bfloat16 holds them in bf16 under a float32 model. Each
repeat generates --max-tokens tokens (ignore_eos) for the same prompts twice, once each request with its adapter
and once on the base model, alternating which goes first. Throughput = generated tokens / wall time; ratio =
LoRA / base, medians of the repeats.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

from nanovllm_tp.bench import common as bc
from nanovllm_tp.config.engine_config import add_engine_args, engine_kwargs

NAME = "bench_lora"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    g = bc.add_paired_workload_args(parser, max_tokens=64)
    g.add_argument("--num-requests", type=int, default=8, help="requests in the batch")
    g.add_argument("--num-adapters", type=int, help="distinct adapters over the requests (default: one each)")
    g.add_argument("--prompt-len", type=int, default=32)
    g.add_argument("--lora-rank", type=int, default=16)
    bc.add_output_args(parser)
    return parser


def make_adapters(model: str, count: int, rank: int, out_dir: str) -> list[str]:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise SystemExit("bench lora makes its adapters with peft: pip install 'nanovllm-tp[bench]'") from None
    import torch
    from transformers import AutoModelForCausalLM
    from nanovllm_tp.checkpoint.gguf import find_gguf
    from nanovllm_tp.launch.make_lora import make_lora
    bc.quiet_transformers()
    gguf = find_gguf(model)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf) if gguf else model, dtype=torch.float32,
                                              **({"gguf_file": os.path.basename(gguf)} if gguf else {}))
    return [make_lora(hf, os.path.join(out_dir, f"lora-{i}"), rank=rank, alpha=2 * rank, seed=i)
            for i in range(count)]


def timed(llm, prompts, params, loras) -> tuple[float, int, int]:
    steps = llm.stats()["num_steps"]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs), llm.stats()["num_steps"] - steps


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    args.num_adapters = args.num_adapters or args.num_requests
    if min(args.repeats, args.num_requests, args.num_adapters, args.lora_rank) < 1:
        raise SystemExit("--repeats, --num-requests, --num-adapters and --lora-rank must be >= 1")
    if args.num_adapters > args.num_requests:
        raise SystemExit(f"--num-adapters {args.num_adapters} exceeds --num-requests {args.num_requests}")
    bc.apply_threads(args)
    args.model_source = args.model or f"preset {args.preset}"
    args.model = bc.resolve_model(args)
    from nanovllm_tp import LLM, LoRARequest, SamplingParams
    kwargs = {**engine_kwargs(args), "enable_lora": True, "max_loras": max(args.max_loras, args.num_adapters),
              "max_lora_rank": max(args.max_lora_rank, args.lora_rank)}
    env = bc.environment()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        paths = make_adapters(args.model, args.num_adapters, args.lora_rank, tmp)
        loras = [LoRARequest(f"lora-{i % len(paths)}", i % len(paths) + 1, paths[i % len(paths)])
                 for i in range(args.num_requests)]
        llm = LLM(**kwargs)
        try:
            vocab = llm.config.model_config.vocab_size
            prompts = [[(97 * i + 13 * j) % vocab for j in range(args.prompt_len)] for i in range(args.num_requests)]
            params = SamplingParams(temperature=args.temperature, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
            warm = SamplingParams(max_tokens=2)
            llm.generate(prompts, warm, use_tqdm=False, lora_request=loras)
            llm.generate(prompts, warm, use_tqdm=False)
            for r in range(args.repeats):
                sides = [("lora", loras), ("base", None)]
                result = {}
                for side, lora in (sides if r % 2 == 0 else sides[::-1]):
                    result[side] = timed(llm, prompts, params, lora)
                (l_s, l_tok, l_steps), (b_s, b_tok, b_steps) = result["lora"], result["base"]
                runs.append({"lora_s": l_s, "base_s": b_s, "tokens": l_tok, "lora_tok_s": l_tok / l_s,
                             "base_tok_s": b_tok / b_s, "ratio": (l_tok / l_s) / (b_tok / b_s),
                             "lora_step_ms": 1e3 * l_s / l_steps, "base_step_ms": 1e3 * b_s / b_steps})
                bc.log(args, f"[{r + 1}/{args.repeats}] LoRA {bc.fmt(runs[-1]['lora_tok_s'])} tok/s, base "
                             f"{bc.fmt(runs[-1]['base_tok_s'])} tok/s, ratio {runs[-1]['ratio']:.3f}")
            linear = llm.stats()["linear"]
            adapter_bytes = sum(llm.engine.runner.lora.slot_bytes())     # rank 0's share, all resident
        finally:
            llm.close()
    figures = {key: bc.median(x[key] for x in runs) for key in runs[0]}
    figures.update(requests=args.num_requests, adapters=args.num_adapters, rank=args.lora_rank, linear=linear,
                   adapter_mb_per_step=adapter_bytes / 1e6)
    result = {"name": NAME, "config": bc.config_dict(args), "environment": bc.finish_environment(env),
              "figures": figures, "runs": runs}
    bc.save_result(args, bc.pathlib.Path(args.out) if args.out else bc.default_out_path(NAME), result,
                   lambda result: None)
    f = figures
    print(bc.format_table(
        ["requests", "adapters", "rank", "adapter MB/step", "tokens", "LoRA tok/s", "base tok/s", "LoRA/base",
         "step ms LoRA", "step ms base"],
        [[f["requests"], f["adapters"], f["rank"], bc.fmt(f["adapter_mb_per_step"]), f["tokens"],
          bc.fmt(f["lora_tok_s"]), bc.fmt(f["base_tok_s"]), f"{f['ratio']:.3f}", bc.fmt(f["lora_step_ms"], 2),
          bc.fmt(f["base_step_ms"], 2)]],
        title=f"requests with adapters (lora_dtype {args.lora_dtype}) vs the base model, medians of "
              f"{args.repeats} ({f['linear']})"),
        flush=True)
    return result


if __name__ == "__main__":
    main()
