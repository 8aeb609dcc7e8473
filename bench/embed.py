"""Embeddings per second: LLM.embed against transformers' AutoModel on the same batch, interleaved in one run.

    python -m nanovllm_tp.bench.embed --model SmolLM2.gguf --batch 32 --prompt-tokens 128 --repeats 5

A batch of --batch passages of the package's corpus, --prompt-tokens tokens each (token ids, the same for both).
The engine pools as the model says (a .gguf: the last token, normalized); transformers runs the batch at once
(right padding, fp32, a .gguf's weights dequantized) and takes each row's last real token, normalized. Figures are
medians of the repeats; "min cosine" is the least agreement between the two on any prompt.
"""
from __future__ import annotations

import os
import time

from nanovllm_tp.bench import common as bc
from nanovllm_tp.config.engine_config import add_engine_args, engine_kwargs
from nanovllm_tp.launch.make_tiny import CORPUS

NAME = "bench_embed"


def build_parser():
    import argparse
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    g = bc.add_paired_workload_args(parser, max_tokens=0)
    g.add_argument("--batch", type=int, default=32, help="prompts per batch")
    g.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt")
    g.add_argument("--no-compare", action="store_true", help="the engine alone")
    bc.add_output_args(parser)
    return parser


def load_hf(model: str):
    import torch
    from transformers import AutoModel
    from nanovllm_tp.checkpoint.gguf import find_gguf
    gguf = find_gguf(model)
    if gguf:
        return AutoModel.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                         dtype=torch.float32).eval()
    return AutoModel.from_pretrained(model, dtype=torch.float32).eval()


def hf_embed(model, prompts: list[list[int]]):
    """Last real token of each row, normalized (float32 [batch, hidden])."""
    import torch
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)], mask[i, :len(p)] = torch.tensor(p), 1
    with torch.inference_mode():
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state
    last = h[torch.arange(len(prompts)), mask.sum(1) - 1]
    return torch.nn.functional.normalize(last.float(), dim=-1)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.repeats < 1 or args.batch < 1 or args.prompt_tokens < 1:
        raise SystemExit("--repeats, --batch and --prompt-tokens must be >= 1")
    bc.apply_threads(args)
    bc.quiet_transformers()
    args.model_source = args.model or f"preset {args.preset}"
    args.model = bc.resolve_model(args)
    import torch
    from nanovllm_tp import LLM
    llm = LLM(**engine_kwargs(args))
    env = bc.environment()
    hf = None if args.no_compare else load_hf(args.model)
    try:
        ids = llm.get_tokenizer().encode(CORPUS.read_text(), add_special_tokens=False)
        n = args.prompt_tokens
        prompts = [ids[(i * n) % max(1, len(ids) - n):][:n] for i in range(args.batch)]
        llm.embed(prompts[:2], use_tqdm=False)                        # warm-up
        runs = {"engine": [], "transformers": []}
        cosines = []
        for r in range(args.repeats):
            start = time.perf_counter()
            outs = llm.embed(prompts, use_tqdm=False)
            runs["engine"].append(args.batch / (time.perf_counter() - start))
            if hf is not None:
                start = time.perf_counter()
                ref = hf_embed(hf, prompts)
                runs["transformers"].append(args.batch / (time.perf_counter() - start))
                got = torch.tensor([o.outputs.embedding for o in outs])
                cosines.append(float(torch.nn.functional.cosine_similarity(got, ref).min()))
            bc.log(args, f"[{r + 1}/{args.repeats}] engine {bc.fmt(runs['engine'][-1])} emb/s" +
                   (f", transformers {bc.fmt(runs['transformers'][-1])} emb/s" if hf is not None else ""))
    finally:
        llm.close()
    figures = {"engine_emb_s": bc.median(runs["engine"]),
               "transformers_emb_s": bc.median(runs["transformers"]) if runs["transformers"] else None,
               "ratio": bc.median(a / b for a, b in zip(runs["engine"], runs["transformers"]))
               if runs["transformers"] else None,
               "min_cosine": min(cosines) if cosines else None}
    result = {"name": NAME, "config": bc.config_dict(args), "environment": bc.finish_environment(env),
              "runs": runs, "figures": figures}
    bc.save_result(args, bc.out_path(args, NAME), result, lambda result: None)
    f = figures
    print(bc.format_table(["engine emb/s", "transformers emb/s", "engine/transformers", "min cosine"],
                          [[bc.fmt(f["engine_emb_s"]), bc.fmt(f["transformers_emb_s"]),
                            "-" if f["ratio"] is None else f"{f['ratio']:.2f}x",
                            "-" if f["min_cosine"] is None else f"{f['min_cosine']:.5f}"]],
                          title=f"{args.batch} prompts of {args.prompt_tokens} tokens, medians of {args.repeats}"),
          flush=True)
    return result


if __name__ == "__main__":
    main()
