"""Speculative decoding against plain decoding, both engines in this process, interleaved in the same run.

    python -m nanovllm_tp.launch.bench_spec --model SmolLM2.gguf --dtype bfloat16 --repeats 3 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'

Two workloads, one request at a time (the single stream speculation is for):
  copy    a passage of --passage-tokens tokens from the package's corpus and an instruction to repeat it
          (through the chat template when the model has one): the output copies the prompt;
  random  random prompt ids (ignore_eos): nothing repeats, which shows what proposing costs when it fails.
Decode tok/s = (output tokens - 1) / (finish - first token); medians of the repeats. Greedy outputs of the two
engines must be equal token for token (speculation is exact); the table says so.

A draft model instead of the n-gram lookup, here the tiny checkpoint drafting for a deeper one of the same seed
whose extra layers stay quiet (so the draft agrees with it on most tokens):

    python -m nanovllm_tp.launch.make_tiny /tmp/draft --layers 2
    python -m nanovllm_tp.launch.make_tiny /tmp/target --layers 24 --quiet-from 2
    python -m nanovllm_tp.launch.bench_spec --model /tmp/target \
        --speculative-config '{"method": "draft_model", "model": "/tmp/draft", "num_speculative_tokens": 4}'

The table's "accepted by place" column: proposals accepted at the draft's first, second, .. place, summed over the
repeats (a place is reached only past the earlier ones).
"""
from __future__ import annotations

import argparse
import random

from nanovllm_tp.config import add_engine_args, engine_kwargs
from nanovllm_tp.launch import bench_common as bc
from nanovllm_tp.launch.make_tiny import CORPUS

NAME = "bench_spec"
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    g = bc.add_paired_workload_args(parser, max_tokens=256)
    g.add_argument("--workloads", nargs="+", choices=["copy", "random"], default=["copy", "random"])
    g.add_argument("--passage-tokens", type=int, default=300, help="length of the passage to copy")
    bc.add_output_args(parser)
    return parser


def copy_prompt(tokenizer, corpus_ids: list[int], passage_tokens: int, draw: int) -> list[int]:
    """A passage of the corpus (its token ids; a different passage per draw) and the instruction to repeat it."""
    start = random.Random(f"copy/{draw}").randrange(max(1, len(corpus_ids) - passage_tokens))
    passage = tokenizer.decode(corpus_ids[start:start + passage_tokens])
    ask = f"{passage}\n\nRepeat the text above exactly, word for word."
    if getattr(tokenizer, "chat_template", None):
        ask = tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                            add_generation_prompt=True)
        return tokenizer.encode(ask, add_special_tokens=False)
    return tokenizer.encode(ask)


def run_one(llm, prompt: list[int], params) -> dict:
    before = llm.stats()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    after, m, c = llm.stats(), out.metrics, out.outputs[0]
    decode_s = m.finish_time - m.first_token_time
    return {"tokens": c.token_ids, "decode_tok_s": (len(c.token_ids) - 1) / decode_s if decode_s > 0 else None,
            "seconds": m.finish_time - m.arrival_time,
            "draft": after["num_draft_tokens"] - before["num_draft_tokens"],
            "per_pos": [a - b for a, b in zip(after["num_accepted_tokens_per_pos"],
                                              before["num_accepted_tokens_per_pos"])],
            "accepted": after["num_accepted_tokens"] - before["num_accepted_tokens"]}


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    bc.apply_threads(args)
    args.model_source = args.model or f"preset {args.preset}"
    args.model = bc.resolve_model(args)
    from nanovllm_tp import LLM, SamplingParams
    kwargs = engine_kwargs(args)
    spec_config = kwargs.pop("speculative_config") or DEFAULT_SPEC
    plain, spec = LLM(**kwargs), LLM(**kwargs, speculative_config=spec_config)
    env = bc.environment()
    try:
        tok, vocab = plain.get_tokenizer(), plain.config.model_config.vocab_size
        corpus_ids = tok.encode(CORPUS.read_text(), add_special_tokens=False)     # once, not per repeat
        for llm in (plain, spec):                            # warm-up
            llm.generate([[1, 2, 3, 4] * 8], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
        runs = {(w, e): [] for w in args.workloads for e in ("plain", "spec")}
        for r in range(args.repeats):
            for w in args.workloads:
                rng = random.Random(f"{args.seed}/random/{r}")
                prompt = copy_prompt(tok, corpus_ids, args.passage_tokens, r) if w == "copy" else \
                    [rng.randrange(min(vocab, bc.MAX_TOKEN_ID)) for _ in range(args.passage_tokens)]
                params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=r,
                                        ignore_eos=w == "random")
                for name, llm in (("plain", plain), ("spec", spec)):
                    runs[w, name].append(run_one(llm, prompt, params))
                    bc.log(args, f"[{r + 1}/{args.repeats}] {w} {name}: "
                                 f"{bc.fmt(runs[w, name][-1]['decode_tok_s'])} tok/s")
    finally:
        plain.close()
        spec.close()
    figures = {}
    for w in args.workloads:
        p, s = runs[w, "plain"], runs[w, "spec"]
        draft, accepted = sum(x["draft"] for x in s), sum(x["accepted"] for x in s)
        per_pos = [sum(col) for col in zip(*(x["per_pos"] for x in s))]
        figures[w] = {"plain_tok_s": bc.median(x["decode_tok_s"] for x in p),
                      "spec_tok_s": bc.median(x["decode_tok_s"] for x in s),
                      "ratio": bc.median(b["decode_tok_s"] / a["decode_tok_s"] for a, b in zip(p, s)),
                      "acceptance": accepted / draft if draft else None,
                      "accepted_per_pos": per_pos,
                      "output_tokens": bc.median(len(x["tokens"]) for x in s),
                      "same_tokens": all(a["tokens"] == b["tokens"] for a, b in zip(p, s))}
    result = {"name": NAME, "config": {**bc.config_dict(args), "speculative_config": spec_config},
              "environment": bc.finish_environment(env), "figures": figures}
    bc.save_result(args, bc.pathlib.Path(args.out) if args.out else bc.default_out_path(NAME), result, lambda result: None)
    rows = [[w, bc.fmt(f["plain_tok_s"]), bc.fmt(f["spec_tok_s"]), f"{f['ratio']:.2f}x",
             "-" if f["acceptance"] is None else f"{f['acceptance']:.2f}",
             " ".join(map(str, f["accepted_per_pos"])) or "-", f["output_tokens"],
             "yes" if f["same_tokens"] else "NO"] for w, f in figures.items()]
    method = spec_config.get("method", "ngram")
    print(bc.format_table(["workload", "plain tok/s", "spec tok/s", "spec/plain", "acceptance", "accepted by place",
                           "out tokens", "same tokens"], rows,
                          title=f"decode, one request, {method} proposals, medians of {args.repeats}"), flush=True)
    return result


if __name__ == "__main__":
    main()
