"""Checkpoint -> parameters and tokenizer. Safetensors files are opened lazily and every rank reads only the
slices it keeps; a .gguf file (gguf_checkpoint) is read the same way, dequantized or as the blocks of its
quantized tensors (keep_blocks); PyTorch .bin files are memory-mapped with torch.load(weights_only=True)."""
import glob
import os

from safetensors import safe_open
from torch import nn

from nanovllm_tp.layers.weight_loading import default_weight_loader


# what a HF directory needs for transformers to build its tokenizer (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


class NoTokenizer:
    """Stands in for the tokenizer of a checkpoint that ships none: token-id prompts still run (their
    completions have token ids and no text); a text prompt or a chat template is refused with a clear error."""

    def __init__(self, model: str):
        self.message = (f"{model!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): pass prompts as "
                        "token-id lists, or add the tokenizer files to the directory")

    def encode(self, *args, **kwargs):
        raise ValueError(self.message)

    __call__ = apply_chat_template = encode

    def decode(self, token_ids, **kwargs) -> str:
        return ""


def load_tokenizer(model: str):
    from transformers import AutoTokenizer
    from nanovllm_tp.checkpoint.gguf import find_gguf, load_tokenizer as gguf_tokenizer
    gguf = find_gguf(model)
    if gguf:
        return gguf_tokenizer(gguf)
    if not any(os.path.isfile(os.path.join(model, name)) for name in TOKENIZER_FILES):
        return NoTokenizer(model)     # transformers would build a one-token vocabulary and decode to ""
    return AutoTokenizer.from_pretrained(model)


def checkpoint_tensors(model_dir: str, keep_blocks: bool = False):
    """(name, lazy tensor, file name) for every tensor of a HF directory's safetensors or of a .gguf file (whose
    quantized tensors come as their blocks with keep_blocks, where layers/quant.py runs their type)."""
    from nanovllm_tp.checkpoint.gguf import find_gguf, iter_weights
    gguf = find_gguf(model_dir)
    if gguf:
        for name, weight in iter_weights(gguf, keep_blocks):
            yield name, weight, os.path.basename(gguf)
        return
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        yield from _torch_bin_tensors(model_dir)
        return
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name), os.path.basename(path)


def _torch_bin_tensors(model_dir: str):
    """PyTorch .bin checkpoints, read with weights_only=True (tensors only, no code from the file) and mmap."""
    import torch
    files = sorted(glob.glob(os.path.join(model_dir, "pytorch_model*.bin")))
    if not files:
        raise ValueError(f"no *.safetensors or pytorch_model*.bin weights in {model_dir!r}")
    for path in files:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise ValueError(f"cannot read {path} as a weights-only PyTorch checkpoint: {exc}") from None
        for name, tensor in state.items():
            yield name, tensor, os.path.basename(path)


def load_model(model: nn.Module, model_dir: str, keep_blocks: bool = False) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_names = set()
    for whole_name, whole, source in checkpoint_tensors(model_dir, keep_blocks):
        if "rotary_emb.inv_freq" in whole_name:
            continue
        for ckpt_name, tensor in model.checkpoint_parts(whole_name, whole):
            target, shard = model.checkpoint_target(ckpt_name)
            param = params.get(target)
            if param is None and not model.holds(target):
                continue        # another pipeline stage's
            if param is None:
                raise ValueError(f"checkpoint tensor {whole_name!r} in {source} has no matching parameter in the "
                                 "model")
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor, *shard)
            loaded_names.add(target)
    missing = {name for name in params if name not in loaded_names}
    if model.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint in {model_dir!r} lacks weights for: {sorted(missing)[:8]}")
