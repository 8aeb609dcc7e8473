"""Speculative decoding against plain decoding, both engines in this process, interleaved in the same run.

    python -m nanovllm_tp.bench.spec --model SmolLM2.gguf --dtype bfloat16 --repeats 3 \\
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
    python -m nanovllm_tp.bench.spec --model /tmp/target \
        --speculative-config '{"method": "draft_model", "model": "/tmp/draft", "num_speculative_tokens": 4}'

The table's "accepted by place" column: proposals accepted at the draft's first, second, .. place, summed over the
repeats (a place is reached only past the earlier ones).
"tokens/step": output tokens per decode step of the speculative engine (a step verifying proposals or, while a
request waits after missed proposals, a plain one); "step cost": its mean decode step's time over the plain
engine's, paired per repeat. Their ratio is the speedup (less the noise of two timings).

Against vLLM's own speculation (its CPU build in a virtualenv of its own; --model must then be a Hugging Face
directory, which launch/convert.py makes from a .gguf), with the same --speculative-config, on the same prompt ids,
interleaved with the two engines here; vLLM's decode tok/s from its own per-request timestamps:

    python -m nanovllm_tp.bench.spec --model SMOLLM2_DIR --dtype bfloat16 --compare vllm \
        --peer-python VENV/bin/python --peer-mode eager --speculative-config '{"method": "ngram", ...}'
"""
from __future__ import annotations

import argparse
import random

from nanovllm_tp.bench import common as bc
from nanovllm_tp.bench import vllm as bench_vllm
from nanovllm_tp.config.engine_config import add_engine_args, engine_kwargs
from nanovllm_tp.launch.make_tiny import CORPUS

NAME = "bench_spec"
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    g = bc.add_paired_workload_args(parser, max_tokens=256)
    g.add_argument("--workloads", nargs="+", choices=["copy", "random"], default=["copy", "random"])
    g.add_argument("--passage-tokens", type=int, default=300, help="length of the passage to copy")
    g.add_argument("--compare", choices=["vllm"], help="also run vLLM with the same speculative config")
    bench_vllm.add_peer_args(parser)
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
    """One request alone; its decode steps are the engine's steps after the prompt's (a step of 1 + k rows when
    it verifies proposals, of one row otherwise)."""
    before = llm.stats()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    after, m, c = llm.stats(), out.metrics, out.outputs[0]
    decode_s = m.finish_time - m.first_token_time
    prefill_steps = -(-len(prompt) // llm.engine.config.max_num_batched_tokens)
    steps = after["num_steps"] - before["num_steps"] - prefill_steps
    return {"tokens": c.token_ids, "decode_tok_s": (len(c.token_ids) - 1) / decode_s if decode_s > 0 else None,
            "seconds": m.finish_time - m.arrival_time, "decode_steps": steps,
            "step_s": decode_s / steps if steps > 0 else None,
            "draft": after["num_draft_tokens"] - before["num_draft_tokens"],
            "per_pos": [a - b for a, b in zip(after["num_accepted_tokens_per_pos"],
                                              before["num_accepted_tokens_per_pos"])],
            "accepted": after["num_accepted_tokens"] - before["num_accepted_tokens"]}


def start_peers(args, llm, spec_config: dict, cold_prompt: list[int]) -> dict:
    """vLLM with the same speculative config, one per --peer-mode, each stopped while the others run."""
    config = {"model": str(args.model), "dtype": str(llm.engine.dtype).removeprefix("torch."),
              "max_model_len": llm.engine.config.max_model_len, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "seed": args.seed, "cold_prompt": cold_prompt,
              "speculative_config": spec_config, "request_times": True}
    penv = bench_vllm.peer_env(args.peer_kv_gib, bc.environment()["torch_threads"])
    peers = {}
    try:
        for mode in bench_vllm.MODES[args.peer_mode]:
            peer_config = {**config, "enforce_eager": mode == "eager"}
            peers[f"vllm-{mode}"] = bench_vllm.PeerProcess(args.peer_python, peer_config, penv, args.peer_timeout)
            bc.log(args, f"vLLM {mode} ready")
    except BaseException:
        for peer in peers.values():
            peer.close()
        raise
    return peers


def run_peer(peer, prompt: list[int], args, ignore_eos: bool) -> dict:
    reply = peer.run([prompt], [args.max_tokens], args.temperature, ignore_eos)
    tokens, decode_s = reply["token_ids"][0], reply["decode_s"][0]
    return {"tokens": tokens, "decode_tok_s": (len(tokens) - 1) / decode_s if decode_s > 0 else None,
            "seconds": reply["seconds"], "draft": reply["spec"]["draft"], "accepted": reply["spec"]["accepted"],
            "per_pos": []}


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    version = bench_vllm.check_peer(args, NAME) if args.compare == "vllm" else None
    bc.apply_threads(args)
    args.model_source = args.model or f"preset {args.preset}"
    args.model = bc.resolve_model(args)
    from nanovllm_tp import LLM, SamplingParams
    kwargs = engine_kwargs(args)
    spec_config = kwargs.pop("speculative_config") or DEFAULT_SPEC
    plain, spec = LLM(**kwargs), LLM(**kwargs, speculative_config=spec_config)
    env, peers = bc.environment(), {}
    try:
        tok, vocab = plain.get_tokenizer(), plain.config.model_config.vocab_size
        corpus_ids = tok.encode(CORPUS.read_text(), add_special_tokens=False)     # once, not per repeat
        for llm in (plain, spec):                            # warm-up
            llm.generate([[1, 2, 3, 4] * 8], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
        if args.compare == "vllm":
            peers = start_peers(args, plain, spec_config, [1, 2, 3, 4] * 8)
        engines = ("plain", "spec", *peers)
        runs = {(w, e): [] for w in args.workloads for e in engines}
        for r in range(args.repeats):
            for w in args.workloads:
                rng = random.Random(f"{args.seed}/random/{r}")
                prompt = copy_prompt(tok, corpus_ids, args.passage_tokens, r) if w == "copy" else \
                    [rng.randrange(min(vocab, bc.MAX_TOKEN_ID)) for _ in range(args.passage_tokens)]
                params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=r,
                                        ignore_eos=w == "random")
                for name in engines:
                    llm = {"plain": plain, "spec": spec}.get(name)
                    runs[w, name].append(run_one(llm, prompt, params) if llm is not None else
                                         run_peer(peers[name], prompt, args, ignore_eos=w == "random"))
                    bc.log(args, f"[{r + 1}/{args.repeats}] {w} {name}: "
                                 f"{bc.fmt(runs[w, name][-1]['decode_tok_s'])} tok/s")
    finally:
        plain.close()
        spec.close()
        for peer in peers.values():
            peer.close()
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
                      # tokens per decode step and the cost of a step against a plain one: their ratio is the gain
                      "tokens_per_step": bc.median((len(x["tokens"]) - 1) / x["decode_steps"] for x in s
                                                   if x["decode_steps"] > 0),
                      "step_cost_ratio": bc.median(b["step_s"] / a["step_s"] for a, b in zip(p, s)
                                                   if a["step_s"] and b["step_s"]),
                      "output_tokens": bc.median(len(x["tokens"]) for x in s),
                      "same_tokens": all(a["tokens"] == b["tokens"] for a, b in zip(p, s))}
        for name in peers:
            v = runs[w, name]
            draft, accepted = sum(x["draft"] for x in v), sum(x["accepted"] for x in v)
            figures[w][name] = {"tok_s": bc.median(x["decode_tok_s"] for x in v),
                                "spec_over_peer": bc.median(a["decode_tok_s"] / b["decode_tok_s"]
                                                            for a, b in zip(s, v)),
                                "acceptance": accepted / draft if draft else None,
                                "output_tokens": bc.median(len(x["tokens"]) for x in v),
                                "same_tokens": sum(a["tokens"] == b["tokens"] for a, b in zip(s, v))}
    result = {"name": NAME, "config": {**bc.config_dict(args), "speculative_config": spec_config},
              "environment": {**bc.finish_environment(env), "vllm": version}, "figures": figures}
    out = bc.pathlib.Path(args.out) if args.out else bc.default_out_path(NAME)
    bc.save_result(args, out, result, lambda result: None)
    rows = [[w, bc.fmt(f["plain_tok_s"]), bc.fmt(f["spec_tok_s"]), f"{f['ratio']:.2f}x",
             "-" if f["acceptance"] is None else f"{f['acceptance']:.2f}",
             " ".join(map(str, f["accepted_per_pos"])) or "-", bc.fmt(f["tokens_per_step"], 2),
             bc.fmt(f["step_cost_ratio"], 2), f["output_tokens"],
             "yes" if f["same_tokens"] else "NO"] for w, f in figures.items()]
    method = spec_config.get("method", "ngram")
    print(bc.format_table(["workload", "plain tok/s", "spec tok/s", "spec/plain", "acceptance", "accepted by place",
                           "tokens/step", "step cost", "out tokens", "same tokens"], rows,
                          title=f"decode, one request, {method} proposals, medians of {args.repeats}"), flush=True)
    if peers:
        rows = [[w, name, bc.fmt(f["spec_tok_s"]), bc.fmt(f[name]["tok_s"]), f"{f[name]['spec_over_peer']:.2f}x",
                 "-" if f[name]["acceptance"] is None else f"{f[name]['acceptance']:.2f}", f[name]["output_tokens"],
                 f"{f[name]['same_tokens']}/{args.repeats}"] for w, f in figures.items() for name in peers]
        print(bc.format_table(["workload", "peer", "spec tok/s", "peer spec tok/s", "spec/peer", "peer acceptance",
                               "peer out tokens", "same tokens"], rows,
                              title=f"against vLLM {version} with the same speculative config"), flush=True)
    return result


if __name__ == "__main__":
    main()
