"""GGUF checkpoints (llama.cpp's single-file format): find the file, read its config and tokenizer through
transformers, and hand its tensors to the loader dequantized, under their HF names.

Weights are dequantized with the `gguf` package; transformers' GGUF helpers supply the GGUF -> HF name map
and undo the row permutation llama.cpp applies to Llama's q/k projections. A quantized tensor is dequantized
only for the rows a rank keeps when no permutation is involved.
"""
import functools
import glob
import os

import numpy as np
import torch

# GGUF architectures whose tensors map onto the engine's models one to one (MoE files pack experts differently)
SUPPORTED = ("llama", "qwen2", "qwen3")


def find_gguf(model: str) -> str | None:
    """The .gguf file `model` names: the path itself, or the one .gguf in a directory without config.json."""
    if os.path.isfile(model) and model.endswith(".gguf"):
        return os.path.abspath(model)
    if not os.path.isdir(model) or os.path.isfile(os.path.join(model, "config.json")):
        return None
    found = sorted(glob.glob(os.path.join(model, "*.gguf")))
    if len(found) > 1:
        raise ValueError(f"{model!r} holds several .gguf files ({', '.join(map(os.path.basename, found))}); "
                         "pass the one to load")
    return os.path.abspath(found[0]) if found else None


def _require_gguf():
    try:
        import gguf
    except ImportError:
        raise ValueError("reading a .gguf file needs the gguf package: pip install gguf") from None
    return gguf


@functools.lru_cache(maxsize=2)
def _reader(path: str):
    return _require_gguf().GGUFReader(path)


@functools.lru_cache(maxsize=2)
def hf_config(path: str):
    from transformers import AutoConfig
    _require_gguf()
    return AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def load_tokenizer(path: str):
    """transformers' tokenizer built from the file's vocabulary, merges, special tokens and chat template."""
    from transformers import AutoTokenizer
    _require_gguf()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


class GGUFWeight:
    """One tensor of the file, read lazily like a safetensors slice: get_shape() and [rows] / [:, cols]."""

    def __init__(self, tensor, processor, permuted: bool):
        self.tensor, self.processor, self.permuted = tensor, processor, permuted

    def get_shape(self) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self.tensor.shape))     # GGUF lists dimensions innermost first

    def _dequantize(self, data) -> np.ndarray:
        return _require_gguf().dequantize(data, self.tensor.tensor_type).reshape(-1, *self.get_shape()[1:])

    def __getitem__(self, key) -> torch.Tensor:
        if isinstance(key, slice) and not self.permuted:     # rows only: dequantize just those
            return torch.from_numpy(self._dequantize(self.tensor.data[key]))
        weights = self._dequantize(self.tensor.data)
        if self.permuted:
            weights = self.processor.process(weights=weights, name=self.tensor.name).weights
        return torch.from_numpy(np.ascontiguousarray(weights[key]))


def iter_weights(path: str):
    """(HF tensor name, GGUFWeight) for every tensor of the file the HF model has."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, \
        get_gguf_hf_weights_map
    reader = _reader(path)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    if arch not in SUPPORTED:
        raise ValueError(f"GGUF architecture {arch!r} in {path} is not supported (supported: {', '.join(SUPPORTED)})")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path} stores rope scaling as a rope_freqs tensor, which is not implemented")
    config = hf_config(path)
    with torch.device("meta"):     # only the parameter names matter
        meta = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    name_map = get_gguf_hf_weights_map(meta, processor)
    for tensor in reader.tensors:
        if tensor.name not in name_map:
            raise ValueError(f"GGUF tensor {tensor.name!r} in {path} has no counterpart in the HF model")
        permuted = type(processor) is not TensorProcessor and (".attn_q." in tensor.name or ".attn_k." in tensor.name)
        yield name_map[tensor.name], GGUFWeight(tensor, processor, permuted)
