"""Build small random-weight Qwen3 checkpoints offline, in Hugging Face layout.

The checkpoints are real HF directories (config, generation config, safetensors,
tokenizer with a Qwen-style chat template), so transformers can serve as the
reference implementation in tests. The tokenizer is a byte-level BPE with a
2000-entry vocab trained on the bundled corpus, plus 3 special tokens: the odd
vocab size (2003) exercises vocab-parallel padding.

Init stds are chosen so greedy decoding is not decided by near-ties (which
would make engine-vs-reference comparisons flaky). Measured on the tiny preset,
seed 0, fp32, 8 prompts x 64 greedy steps (`--report-margin`): top-1 minus
top-2 logit margin median 1.58, 5th percentile 0.124; every continuation has at
least 31 distinct tokens. (Seeds 1 and 2: median 1.38 / 1.92, p5 0.121 / 0.160.)

The parts: tiny_tokenizer.py (the BPE, its files), tiny_qwen3.py (the presets' config and weights),
tiny_archs.py (--arch: the other architectures through transformers).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import shutil
import tempfile

import torch
from tokenizers import Tokenizer

from nanovllm_tp import envs
from nanovllm_tp.launch.tiny_archs import ARCHS, make_tiny_arch
from nanovllm_tp.launch.tiny_qwen3 import PRESETS, build_config, random_weights, save_weights
from nanovllm_tp.launch.tiny_tokenizer import (CORPUS, SPECIAL_TOKENS, trained_tokenizer_json, write_json,
                                               write_tokenizer_files)

__all__ = ["make_tiny", "make_tiny_arch", "ensure_tiny", "cached_build", "greedy_margins", "main", "ARCHS", "PRESETS", "CORPUS",
           "SPECIAL_TOKENS", "trained_tokenizer_json", "write_json", "write_tokenizer_files"]
# the files whose code makes a preset's checkpoint: a change to any of them (or to the corpus) makes a new cache
_SOURCES = ("make_tiny.py", "tiny_qwen3.py", "tiny_tokenizer.py")
MARGIN_PROMPTS = ["The quick brown fox", "Return a list of", "def main():", "Hello, world!",
                  "In the beginning", "import os", "The file is opened", "1 2 3 4"]


def make_tiny(out_dir, *, preset: str = "tiny", seed: int = 0, num_shards: int = 1, quiet_from: int | None = None,
              **config_overrides) -> pathlib.Path:
    """Write a random-weight Qwen3 checkpoint to `out_dir`; same arguments give the same bytes. `quiet_from`:
    see random_weights (with num_hidden_layers=6, quiet_from=4: the tiny preset's model drafts for it)."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_str(trained_tokenizer_json())
    config = build_config(preset, tokenizer.get_vocab_size(with_added_tokens=True),
                          tokenizer.token_to_id(SPECIAL_TOKENS[0]), config_overrides)
    write_json(out_dir / "config.json", config)
    write_tokenizer_files(out_dir, config["max_position_embeddings"])
    save_weights(random_weights(config, seed, quiet_from), out_dir, num_shards)
    return out_dir


def ensure_tiny(preset: str = "tiny") -> pathlib.Path:
    """A cached checkpoint, rebuilt whenever the files that make it or the corpus change."""
    here = pathlib.Path(__file__).parent
    sources = b"".join((here / name).read_bytes() for name in _SOURCES)
    digest = hashlib.sha256(sources + CORPUS.read_bytes()).hexdigest()[:16]
    return cached_build(f"{preset}-{digest}", lambda d: make_tiny(d, preset=preset))


def cached_build(name: str, build, leaf: str | None = None) -> pathlib.Path:
    """The cache directory `name` (its file `leaf`, if given), made by build(dir) the first time."""
    cache_root = pathlib.Path(envs.get("NANOVLLM_TP_CACHE") or pathlib.Path.home() / ".cache" / "nanovllm_tp")
    final_dir = cache_root / name
    if final_dir.is_dir():
        return final_dir / leaf if leaf else final_dir
    cache_root.mkdir(parents=True, exist_ok=True)
    # Build beside the final path and rename: readers never see a half-written
    # directory, and if another process wins the race we keep its copy.
    tmp_dir = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_root))
    try:
        tmp_dir.chmod(0o755)  # mkdtemp makes it owner-only; a cache should read like any directory
        build(tmp_dir)
        os.rename(tmp_dir, final_dir)
    except OSError:
        if not final_dir.is_dir():
            raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return final_dir / leaf if leaf else final_dir


def greedy_margins(model_dir, prompts=MARGIN_PROMPTS, steps: int = 64) -> tuple[list[float], list[list[int]]]:
    """Top-1 minus top-2 logit at every greedy step of transformers' fp32 reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    margins, continuations = [], []
    for prompt in prompts:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        # min_new_tokens: an early EOS must not shorten the sample (output_logits stay raw).
        out = model.generate(input_ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
        for step_logits in out.logits:
            top2 = step_logits[0].float().topk(2).values
            margins.append((top2[0] - top2[1]).item())
        continuations.append(out.sequences[0, input_ids.shape[1]:].tolist())
    return margins, continuations


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--arch", choices=sorted(ARCHS), help="another architecture (small random checkpoint "
                        "initialised through transformers) instead of the Qwen3 preset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    parser.add_argument("--quiet-from", type=int, help="layers from this one on write little into the residual "
                        "stream: the checkpoint of this many layers (same preset and seed) drafts well for it")
    parser.add_argument("--report-margin", action="store_true", help="measure greedy top-1/top-2 logit margins")
    args = parser.parse_args(argv)
    if args.arch:
        make_tiny_arch(args.out_dir, args.arch, seed=args.seed)
        out_dir = pathlib.Path(args.out_dir)
    else:
        layers = {} if args.layers is None else {"num_hidden_layers": args.layers}
        out_dir = make_tiny(args.out_dir, preset=args.preset, seed=args.seed, num_shards=args.shards,
                            quiet_from=args.quiet_from, **layers)
    for path in sorted(out_dir.iterdir()):
        print(f"{path}  {path.stat().st_size} bytes")
    if args.report_margin:
        margins, continuations = greedy_margins(out_dir)
        median, p5 = torch.tensor(margins).quantile(torch.tensor([0.5, 0.05])).tolist()
        distinct = min(len(set(c)) for c in continuations)
        print(f"greedy margin over {len(margins)} steps: median {median:.3f}, p5 {p5:.3f}, "
              f"min distinct tokens per continuation {distinct}")


if __name__ == "__main__":
    main()
