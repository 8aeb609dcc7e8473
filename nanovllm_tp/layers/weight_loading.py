"""Weight loading: each parameter carries a weight_loader that copies this rank's slice of a checkpoint tensor.

Loaders receive either a tensor or a lazy safetensors slice; both support shape lookup (via `shape_of`) and
`[a:b]` indexing, so a rank only ever reads the rows or columns it keeps. A GGUF weight that stays quantized
(layers/quant.py) arrives as QuantBlocks: `load_rows` keeps its blocks in `param.blocks` (the dense storage is
never written), and packed_linear.pack_cpu_weights packs them for csrc/linear_q.c.
"""
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm_tp.layers import quant
from nanovllm_tp.layers.quant import QuantBlocks


def shape_of(loaded) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, (torch.Tensor, QuantBlocks)) else tuple(loaded.get_shape())


def take_rows(loaded, start: int, size: int) -> torch.Tensor:
    return loaded[start:start + size]


@dataclass(slots=True)
class RowRange:
    """Rows start..start+size of a checkpoint tensor (a lazy slice or a tensor), itself read lazily: one part
    of a fused weight (Phi-3's qkv_proj) handed to the weight_loader of the parameter it fills."""
    loaded: object
    start: int
    size: int

    def get_shape(self) -> tuple[int, ...]:
        return (self.size, *shape_of(self.loaded)[1:])

    def __getitem__(self, key):
        rows, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        first, stop, step = rows.indices(self.size)
        if step != 1:
            raise ValueError("a RowRange is read in runs of rows")
        part = self.loaded[self.start + first:self.start + max(first, stop)]
        return part[(slice(None), *rest)] if rest else part


def take_cols(loaded, start: int, size: int) -> torch.Tensor:
    return loaded[:, start:start + size]


def copy_checked(dst: torch.Tensor, src, name: str = "weight") -> None:
    if isinstance(src, QuantBlocks):     # a layer that keeps no blocks
        src = src.dequantize()
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint {name} slice has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}")
    dst.copy_(src)


_UNSET = object()


def load_rows(param: nn.Parameter, offset: int, src) -> None:
    """Copy src (a tensor, or QuantBlocks) into rows offset.. of param. Blocks stay blocks, in param.blocks
    (`quant.write_rows`: a merged layer whose q, k, v differ in type keeps each part's); a dense part turns the
    whole parameter dense, dequantized, as does a part that is not a whole-row 2-D weight."""
    dst = param.data[offset:offset + shape_of(src)[0]]
    blocks = getattr(param, "blocks", _UNSET)
    if isinstance(src, QuantBlocks):
        if tuple(dst.shape) != src.shape or param.dim() != 2:
            raise ValueError(f"checkpoint weight slice has shape {src.shape}, the model expects {tuple(dst.shape)}")
        if blocks is _UNSET:
            blocks = QuantBlocks.zeros(*param.shape, src.qtype)
        if blocks is not None:
            param.blocks = quant.write_rows(blocks, offset, src)
            return
        src = src.dequantize()
    if blocks is not _UNSET and blocks is not None:
        param.data.copy_(blocks.dequantize())
    param.blocks = None
    copy_checked(dst, src)


def default_weight_loader(param: nn.Parameter, loaded, *shard) -> None:
    """Whole-tensor copy, for replicated parameters (norms, biases of row-parallel layers)."""
    load_rows(param, 0, loaded[:])
