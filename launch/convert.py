"""Write a .gguf checkpoint out as a plain Hugging Face directory that any engine reads.

    python -m nanovllm_tp.launch.convert MODEL.gguf OUT_DIR [--dtype bfloat16]

The weights are dequantized (so the directory holds what the engine computes with when it loads the .gguf
itself), config.json carries the architecture and dtype and both rope layouts (transformers 4.x reads a flat
rope_theta, 5.x rope_parameters), and the tokenizer keeps the file's chat template.
"""
import argparse
import json
import os
import pathlib

import torch
from safetensors.torch import save_file

from nanovllm_tp.checkpoint.gguf import find_gguf, hf_config, iter_weights, load_tokenizer
from nanovllm_tp.config.engine_config import ModelConfig
from nanovllm_tp.launch.make_tiny import write_json

DTYPES = ("float32", "bfloat16", "float16")
SHARD_BYTES = 4 << 30


def convert(model: str, out_dir, dtype: str = "bfloat16", shard_bytes: int = SHARD_BYTES) -> pathlib.Path:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    path = find_gguf(model)
    if path is None:
        raise ValueError(f"{model!r} is neither a .gguf file nor a directory holding one")
    mc = ModelConfig.from_pretrained(path)     # refuses what the engine could not run either
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = hf_config(path).to_dict()
    config.pop("_model_name_or_path", None)
    config.update(architectures=[mc.architecture], dtype=dtype, torch_dtype=dtype, rope_theta=mc.rope_theta,
                  rope_scaling=mc.rope_scaling)
    write_json(out_dir / "config.json", config)
    eos = list(mc.eos_token_ids)
    write_json(out_dir / "generation_config.json", {"bos_token_id": config.get("bos_token_id"),
                                                      "eos_token_id": eos[0] if len(eos) == 1 else eos})
    write_tokenizer(path, out_dir)
    write_weights(((name, w[:].to(getattr(torch, dtype)).contiguous()) for name, w in iter_weights(path)), out_dir,
                  shard_bytes)
    return out_dir


def write_tokenizer(path: str, out_dir: pathlib.Path) -> None:
    """The tokenizer of GGUF file `path` as HF tokenizer files in out_dir, its chat template included."""
    tokenizer = load_tokenizer(path)
    tokenizer.save_pretrained(out_dir)
    # older transformers (and engines built on it) know the fast tokenizer by this class name and read the chat
    # template from tokenizer_config.json
    tok_config = json.loads((out_dir / "tokenizer_config.json").read_text())
    for key in ("is_local", "local_files_only", "backend"):
        tok_config.pop(key, None)
    tok_config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=tokenizer.chat_template)
    write_json(out_dir / "tokenizer_config.json", tok_config)


def write_weights(tensors, out_dir: pathlib.Path, shard_bytes: int = SHARD_BYTES) -> None:
    """model.safetensors, or shards of at most shard_bytes plus the index HF loaders read; one shard is held in
    memory at a time."""
    for stale in out_dir.glob("model*.safetensors*"):
        stale.unlink()
    shards, current, size = [], {}, 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(_save_shard(current, out_dir, len(shards)))
            current, size = {}, 0
        current[name], size = tensor, size + nbytes
    if not shards:
        save_file(current, out_dir / "model.safetensors", metadata={"format": "pt"})
        return
    shards.append(_save_shard(current, out_dir, len(shards)))
    weight_map, total = {}, 0
    for index, (tmp_name, names, nbytes) in enumerate(shards, start=1):
        final = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        (out_dir / tmp_name).rename(out_dir / final)
        weight_map.update(dict.fromkeys(names, final))
        total += nbytes
    write_json(out_dir / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _save_shard(tensors: dict, out_dir: pathlib.Path, index: int) -> tuple[str, list[str], int]:
    name = f"model-part{index:05d}.safetensors"     # renamed once the shard count is known
    save_file(tensors, out_dir / name, metadata={"format": "pt"})
    return name, list(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a .gguf file, or a directory holding one")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    args = parser.parse_args(argv)
    out_dir = convert(args.model, args.out_dir, args.dtype)
    for path in sorted(out_dir.iterdir()):
        print(f"{path}  {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
