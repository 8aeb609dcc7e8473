"""Structured outputs against the same requests unconstrained, in one engine, interleaved in the same run.

    python -m nanovllm_tp.bench.structured --model SmolLM2.gguf --num-requests 32 --repeats 3

Each repeat sends --num-requests chat requests at once (through the chat template when the model has one) asking
for a JSON record, constrained by a JSON schema (nested object, bounded array, enum, integer range), and the
same prompts unconstrained with each request's max_tokens set to the token count its constrained answer had
(ignore_eos; seeds are the same every repeat, so are the answers), so both sides generate the same number of
tokens; the two runs alternate which goes first. Throughput = generated tokens / wall time;
ratio = constrained / unconstrained, medians of the repeats. The grammar mask's cost per step (llguidance filling
every constrained row's bitmask; LLM.stats' grammar counters) and the first compile of the schema are printed
too; every constrained output is checked against the schema (jsonschema, where installed).
"""
from __future__ import annotations

import argparse
import json
import time

from nanovllm_tp.bench import common as bc
from nanovllm_tp.config.engine_config import add_engine_args, engine_kwargs

NAME = "bench_struct"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["engineer", "doctor", "teacher", "artist", "other"]},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                 "country": {"type": "string", "maxLength": 24}},
                "required": ["city", "country"], "additionalProperties": False},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 4}},
    "required": ["name", "age", "role", "address", "skills"], "additionalProperties": False}
TOPICS = ["a chef in Lyon", "a pilot", "a retired teacher", "a young painter", "a nurse in Oslo", "a farmer",
          "a software engineer", "a violinist"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    g = bc.add_paired_workload_args(parser, max_tokens=160)
    g.add_argument("--num-requests", type=int, default=32)
    bc.add_output_args(parser)
    return parser


def prompts_of(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        ask = f"Describe {TOPICS[i % len(TOPICS)]} (person {i}) as a JSON record: name, age, role, address, skills."
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                                 add_generation_prompt=True)
            out.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            out.append(tokenizer.encode(ask))
    return out


def timed(llm, prompts, params) -> tuple[list, float, dict]:
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.stats()
    return outs, seconds, {k: after[k] - before[k] for k in ("num_steps", "grammar_mask_steps", "grammar_masks",
                                                             "grammar_mask_seconds")}


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.repeats < 1 or args.num_requests < 1:
        raise SystemExit("--repeats and --num-requests must be >= 1")
    bc.apply_threads(args)
    args.model_source = args.model or f"preset {args.preset}"
    args.model = bc.resolve_model(args)
    from nanovllm_tp import LLM, SamplingParams
    from nanovllm_tp.sampling_params import StructuredOutputsParams
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    llm = LLM(**engine_kwargs(args))
    env = bc.environment()
    runs, invalid = [], 0
    try:
        prompts = prompts_of(llm.get_tokenizer(), args.num_requests)
        # warm-up, and every prompt in the prefix cache: no run pays a prefill the other gets from the cache
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
        start = time.perf_counter()
        llm.grammars.compile(StructuredOutputsParams(json=SCHEMA))
        compile_s = time.perf_counter() - start
        constrained = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=args.max_tokens,
                                      structured_outputs=StructuredOutputsParams(json=SCHEMA))
                       for i in range(len(prompts))]
        free = lengths = None
        for r in range(args.repeats):
            if free is not None and r % 2:              # odd repeats: the unconstrained run first
                _, f_sec, f_counts = timed(llm, prompts, free)
            outs, s_sec, s_counts = timed(llm, prompts, constrained)
            for o in outs:
                if o.outputs[0].finish_reason != "stop":
                    invalid += 1
                elif jsonschema is not None:
                    try:
                        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
                    except (ValueError, jsonschema.ValidationError):
                        invalid += 1
            if free is None:         # the same seeds every repeat: the same answers, so the first run's lengths
                lengths = [len(o.outputs[0].token_ids) for o in outs]
                free = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=n, ignore_eos=True)
                        for i, n in enumerate(lengths)]
            if not r % 2:
                _, f_sec, f_counts = timed(llm, prompts, free)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            if tokens != sum(lengths):
                bc.log(args, f"[{r + 1}] the constrained answers changed length: {tokens} against {sum(lengths)}")
            runs.append({"tokens": tokens, "constrained_s": s_sec, "free_s": f_sec,
                         "constrained_tok_s": tokens / s_sec, "free_tok_s": sum(lengths) / f_sec,
                         "ratio": tokens / s_sec / (sum(lengths) / f_sec), "constrained_steps": s_counts["num_steps"],
                         "free_steps": f_counts["num_steps"], "mask_steps": s_counts["grammar_mask_steps"],
                         "masks": s_counts["grammar_masks"], "mask_s": s_counts["grammar_mask_seconds"]})
            bc.log(args, f"[{r + 1}/{args.repeats}] constrained {bc.fmt(runs[-1]['constrained_tok_s'])} tok/s, "
                         f"unconstrained {bc.fmt(runs[-1]['free_tok_s'])} tok/s, ratio {runs[-1]['ratio']:.3f}")
    finally:
        llm.close()
    figures = {
        "requests": args.num_requests, "tokens": bc.median(x["tokens"] for x in runs),
        "constrained_tok_s": bc.median(x["constrained_tok_s"] for x in runs),
        "free_tok_s": bc.median(x["free_tok_s"] for x in runs), "ratio": bc.median(x["ratio"] for x in runs),
        "step_ms_constrained": bc.median(1e3 * x["constrained_s"] / x["constrained_steps"] for x in runs),
        "step_ms_free": bc.median(1e3 * x["free_s"] / x["free_steps"] for x in runs),
        "mask_ms_per_step": bc.median(1e3 * x["mask_s"] / max(x["mask_steps"], 1) for x in runs),
        "mask_us_per_row": bc.median(1e6 * x["mask_s"] / max(x["masks"], 1) for x in runs),
        "first_compile_ms": 1e3 * compile_s, "invalid_outputs": invalid}
    result = {"name": NAME, "config": bc.config_dict(args), "schema": SCHEMA,
              "environment": bc.finish_environment(env), "figures": figures, "runs": runs}
    bc.save_result(args, bc.out_path(args, NAME), result, lambda result: None)
    f = figures
    print(bc.format_table(
        ["requests", "tokens", "JSON tok/s", "free tok/s", "JSON/free", "step ms JSON", "step ms free",
         "mask ms/step", "mask us/row", "compile ms", "invalid"],
        [[f["requests"], f["tokens"], bc.fmt(f["constrained_tok_s"]), bc.fmt(f["free_tok_s"]), f"{f['ratio']:.3f}",
          bc.fmt(f["step_ms_constrained"], 2), bc.fmt(f["step_ms_free"], 2), bc.fmt(f["mask_ms_per_step"], 3),
          bc.fmt(f["mask_us_per_row"]), bc.fmt(f["first_compile_ms"], 2), f["invalid_outputs"]]],
        title=f"JSON schema vs unconstrained, same requests and token counts, medians of {args.repeats}"),
        flush=True)
    return result


if __name__ == "__main__":
    main()
