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
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.resources
import json
import os
import pathlib
import shutil
import tempfile

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nanovllm_tp import envs

PRESETS = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, torch_dtype="float32"),
    "small": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=64, tie_word_embeddings=False, torch_dtype="bfloat16"),
    # Qwen3-0.6B's shape and vocabulary size (the tokenizer stays the tiny BPE): for throughput on a GPU
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       torch_dtype="bfloat16"),
}
BPE_VOCAB_SIZE = 2000
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # appended after BPE: ids 2000..2002
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Tuned with --report-margin (sweep of EMBED_STD x PROJ_GAIN, seeds 0-2). The logit
# spread is ~EMBED_STD * sqrt(hidden_size) and top-1 gaps scale with it, but with tied
# weights a large embedding lets the current token's own row win, so greedy decoding
# repeats it; PROJ_GAIN > 1 makes the layers, not the input embedding, dominate the
# residual stream. EMBED_STD 0.7 / gain 2.0 keeps the median margin > 1.3 with 30+
# distinct tokens in every 64-token continuation.
EMBED_STD = 0.7          # absolute std of embed_tokens (and of an untied lm_head)
PROJ_GAIN = 2.0          # every projection: std = PROJ_GAIN / sqrt(fan_in)
NORM_NOISE_STD = 0.05    # norm weights are 1 + noise, so a dropped norm weight is caught
QUIET_GAIN = 0.05        # output projections of the layers past --quiet-from (a draft's target)
CORPUS = importlib.resources.files("nanovllm_tp") / "data" / "corpus.txt"
MARGIN_PROMPTS = ["The quick brown fox", "Return a list of", "def main():", "Hello, world!",
                  "In the beginning", "import os", "The file is opened", "1 2 3 4"]


@functools.lru_cache(maxsize=1)
def trained_tokenizer_json() -> str:
    """Train the BPE once per process; training is deterministic, so the JSON is too."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with importlib.resources.as_file(CORPUS) as corpus_path:
        tokenizer.train([str(corpus_path)], trainer)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer.to_str()


def build_config(preset: str, vocab_size: int, eos_id: int, overrides: dict) -> dict:
    config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=vocab_size,
                  hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
                  rope_theta=1e6, rope_scaling=None, attention_bias=False, attention_dropout=0.0,
                  use_cache=True, use_sliding_window=False, sliding_window=None,
                  bos_token_id=eos_id, eos_token_id=eos_id, initializer_range=0.02)
    config.update(PRESETS[preset])
    config.update(overrides)
    # transformers >= 5 reads rope/dtype from these keys; older versions from the legacy ones.
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    config["torch_dtype"] = config["dtype"] = overrides.get("dtype", config["torch_dtype"])
    config.setdefault("max_window_layers", config["num_hidden_layers"])
    return config


def random_weights(config: dict, seed: int, quiet_from: int | None = None) -> dict[str, torch.Tensor]:
    """HF Qwen3 parameter names and shapes, filled from a generator seeded by `seed` (so a deeper checkpoint of
    the same seed shares the shallower one's embedding and first layers). Layers from `quiet_from` on write
    QUIET_GAIN times less into the residual stream: such a checkpoint stays close to, not equal to, the one of
    `quiet_from` layers, which then makes a draft model for it with most but not all proposals right."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def linear(out_features, in_features):
        return torch.randn(out_features, in_features, generator=generator) * (PROJ_GAIN / in_features**0.5)

    def norm(size):
        return 1.0 + NORM_NOISE_STD * torch.randn(size, generator=generator)

    weights = {"model.embed_tokens.weight": EMBED_STD * torch.randn(config["vocab_size"], hidden, generator=generator)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        attn_shapes = {"q_proj": (q_dim, hidden), "k_proj": (kv_dim, hidden),
                       "v_proj": (kv_dim, hidden), "o_proj": (hidden, q_dim)}
        quiet = QUIET_GAIN if quiet_from is not None and i >= quiet_from else 1.0
        for name, shape in attn_shapes.items():
            weights[f"{prefix}self_attn.{name}.weight"] = linear(*shape) * (quiet if name == "o_proj" else 1.0)
            if config["attention_bias"]:
                weights[f"{prefix}self_attn.{name}.bias"] = 0.1 * torch.randn(shape[0], generator=generator)
        weights[prefix + "self_attn.q_norm.weight"] = norm(head_dim)
        weights[prefix + "self_attn.k_norm.weight"] = norm(head_dim)
        weights[prefix + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[prefix + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[prefix + "mlp.down_proj.weight"] = linear(hidden, inter) * quiet
        weights[prefix + "input_layernorm.weight"] = norm(hidden)
        weights[prefix + "post_attention_layernorm.weight"] = norm(hidden)
    weights["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = EMBED_STD * torch.randn(config["vocab_size"], hidden, generator=generator)
    dtype = getattr(torch, config["torch_dtype"])
    return {name: tensor.to(dtype).contiguous() for name, tensor in weights.items()}


def save_weights(weights: dict[str, torch.Tensor], out_dir: pathlib.Path, num_shards: int) -> None:
    if not 1 <= num_shards <= len(weights):
        raise ValueError(f"num_shards must be in 1..{len(weights)}, got {num_shards}")
    for stale in out_dir.glob("model*.safetensors*"):  # a rerun with other shards must not mix files
        stale.unlink()
    if num_shards == 1:
        save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
        return
    sizes = {name: t.numel() * t.element_size() for name, t in weights.items()}
    total, written, groups = sum(sizes.values()), 0, [[]]
    for i, name in enumerate(weights):  # whole tensors, balanced by bytes, no shard left empty
        shards_to_open, tensors_left = num_shards - len(groups), len(weights) - i
        if groups[-1] and shards_to_open and (written >= total * len(groups) / num_shards
                                              or tensors_left == shards_to_open):
            groups.append([])
        groups[-1].append(name)
        written += sizes[name]
    weight_map = {}
    for index, names in enumerate(groups, start=1):
        filename = f"model-{index:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: weights[n] for n in names}, out_dir / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, filename))
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_json(out_dir / "model.safetensors.index.json", index_json)


def write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


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


def write_tokenizer_files(out_dir: pathlib.Path, model_max_length: int) -> int:
    """The trained BPE, its special tokens, chat template and generation config; returns the EOS id."""
    tokenizer_json = trained_tokenizer_json()
    eos = SPECIAL_TOKENS[0]
    eos_id = Tokenizer.from_str(tokenizer_json).token_to_id(eos)
    write_json(out_dir / "generation_config.json", {"bos_token_id": eos_id, "eos_token_id": eos_id,
                                                      "do_sample": False})
    (out_dir / "tokenizer.json").write_text(tokenizer_json)
    special_tokens = {"eos_token": eos, "pad_token": eos, "additional_special_tokens": SPECIAL_TOKENS[1:]}
    write_json(out_dir / "special_tokens_map.json", special_tokens)
    write_json(out_dir / "tokenizer_config.json", {
        **special_tokens, "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "add_bos_token": False, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
        "model_max_length": model_max_length})
    return eos_id


# Other architectures: small random checkpoints initialised through transformers (model_type -> config beyond
# ARCH_SHAPE). Projections get std 1.5 / sqrt(fan_in) and embeddings 0.7, so greedy steps are decided by clear
# margins; the MoE router favours experts 0-1 and neglects 6-7, so expert loads are uneven.
ARCH_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
ARCHS = {"llama": {}, "qwen2": {}, "mistral": {"sliding_window": None},
         "qwen3_moe": dict(moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                           mlp_only_layers=[1], norm_topk_prob=True),
         # a window of 24 on layers 0 and 2, a scale of 24 ** -0.5 rather than head_dim's, an attention cap low
         # enough to change the tokens (Gemma 2 ships 50 for scores of another size); untied, as tied embeddings
         # scaled by sqrt(hidden) make greedy decoding repeat the prompt's last token
         "gemma2": dict(sliding_window=24, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                        final_logit_softcapping=30.0),
         # layers 0, 1 windowed (24 tokens, RoPE base 100), layer 2 global (base 1e6, linear scaling)
         "gemma3_text": dict(sliding_window=24, query_pre_attn_scalar=24, sliding_window_pattern=3,
                             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                              "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                 "rope_theta": 1e6}}),
         # Phi-4-mini's shape of attention: 3/4 of each head rotates; a window of 40 on every layer
         "phi3": dict(partial_rotary_factor=0.75, sliding_window=40, original_max_position_embeddings=1024,
                      pad_token_id=None)}
NOISY_NORMS = {"gemma2", "gemma3_text", "phi3"}     # norm weights get noise here (the others keep transformers' init)


def make_tiny_arch(out_dir, model_type: str, *, seed: int = 0, **config_overrides):
    """Write a random checkpoint of `model_type` (a key of ARCHS) with the tiny tokenizer; returns the
    transformers model (fp32), the reference for tests."""
    from transformers import AutoConfig, AutoModelForCausalLM
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    eos_id = write_tokenizer_files(out_dir, ARCH_SHAPE["max_position_embeddings"])
    vocab = Tokenizer.from_str(trained_tokenizer_json()).get_vocab_size(with_added_tokens=True)
    config = AutoConfig.for_model(model_type, vocab_size=vocab, eos_token_id=eos_id, bos_token_id=eos_id,
                                  **{**ARCH_SHAPE, **ARCHS[model_type], **config_overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                if model_type in NOISY_NORMS:     # a swapped, dropped or un-offset norm changes the tokens
                    p.add_(NORM_NOISE_STD * torch.randn_like(p))
                continue
            if "embed" in name or "lm_head" in name:
                p.normal_(0, EMBED_STD)
            else:
                p.normal_(0, 1.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1)
            if name.endswith("mlp.gate.weight"):     # wide router rows win top-k often, near-zero ones rarely
                p[:2] *= 4.0
                p[6:] *= 0.05
    model.save_pretrained(out_dir)
    return model


def ensure_tiny(preset: str = "tiny") -> pathlib.Path:
    """A cached checkpoint, rebuilt whenever this file or the corpus changes."""
    digest = hashlib.sha256(pathlib.Path(__file__).read_bytes() + CORPUS.read_bytes()).hexdigest()[:16]
    cache_root = pathlib.Path(envs.get("NANOVLLM_TP_CACHE") or pathlib.Path.home() / ".cache" / "nanovllm_tp")
    final_dir = cache_root / f"{preset}-{digest}"
    if final_dir.is_dir():
        return final_dir
    cache_root.mkdir(parents=True, exist_ok=True)
    # Build beside the final path and rename: readers never see a half-written
    # directory, and if another process wins the race we keep its copy.
    tmp_dir = pathlib.Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=cache_root))
    try:
        tmp_dir.chmod(0o755)  # mkdtemp makes it owner-only; a cache should read like any directory
        make_tiny(tmp_dir, preset=preset)
        os.rename(tmp_dir, final_dir)
    except OSError:
        if not final_dir.is_dir():
            raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return final_dir


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
