"""Weights that stay block-quantized on CPU: GGUF's Q8_0, Q4_0 and Q4_1 (blocks of 32 inputs, an fp16 scale d per
block, and a min m for Q4_1), Q5_0 / Q5_1 and the K-quants Q4_K, Q5_K, Q6_K (layers/quant_kblocks.py unpacks
their super-blocks of 256 into blocks of 32 at load), and int8 per output channel made at load from a dense
checkpoint (quantization "int8": symmetric int8 weights with an fp32 scale per output, as vLLM's W8A8 on CPU;
activations quantized per block of 128 inputs, where vLLM's take one scale per token).

A weight's way: the GGUF reader hands a layer's weight_loader `QuantBlocks` (the rows and columns a rank keeps,
as the file stores them); `linear.load_rows` keeps them beside the parameter, whose dense storage is never
written; `packed_linear.pack_cpu_weights` then makes the form the matmul reads (`pack_blocks`):

- `QuantWeight`: csrc/linear_q.c's layout, where the kernels run (AVX-512 VNNI): activations quantized per row
  and block (`act_block`: 32 for the GGUF types, 128 for int8) to int8 on the fly, integer dot products, fp32 sums;
- `QuantReference` (cpu_kernels off): the torch reference of the same math, dequantized weights in fp32 against
  activations rounded the way the kernel rounds them (`round_activations`).

Where neither runs (CUDA, a CPU without VNNI) the reader dequantizes at load instead (gguf_checkpoint's
`keep_gguf_blocks` decides, the runner logs it).
"""
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from nanovllm_tp.layers import cpu_kernels, quant_kblocks

BLOCK = 32          # the activations' block, and the smallest weight block
# ggml type -> name: the types that stay quantized
GGUF_TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", **quant_kblocks.FIVE, **quant_kblocks.SUPER}
BLOCK_BYTES = {2: 18, 3: 20, 8: 34, **quant_kblocks.BLOCK_BYTES}
BLOCK_SIZE = {2: BLOCK, 3: BLOCK, 8: BLOCK, **quant_kblocks.BLOCK_SIZE}     # inputs per block in the file
INT8 = 100          # csrc/linear_q.c's code for int8 per output channel: rows of [fp32 scale][in_features int8]
# int8's activation block (csrc/linear_q.c's I8_SPAN blocks of 32): on SmolLM2 one scale per row cost 3.96% of
# perplexity, blocks of 128 1.03% (blocks of 32 0.44%, with an int32 -> fp32 step per 32 inputs instead of 128)
INT8_BLOCK = 128
NAMES = {**GGUF_TYPES, INT8: "int8"}
INV127 = torch.tensor(np.float32(1) / np.float32(127))     # the kernel's 1.0f / 127.0f


@dataclass(slots=True)
class QuantBlocks:
    """Rows of a block-quantized weight as GGUF stores them: data [rows, in_features / 32 * block bytes] uint8
    of ggml type qtype."""
    data: torch.Tensor
    qtype: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.in_features

    @classmethod
    def zeros(cls, rows: int, in_features: int, qtype: int) -> "QuantBlocks":
        return cls(torch.zeros(rows, in_features // BLOCK_SIZE[qtype] * BLOCK_BYTES[qtype], dtype=torch.uint8),
                   qtype, in_features)

    def columns(self, start: int, size: int, name: str) -> "QuantBlocks":
        """Inputs start..start+size; a rank's slice must hold whole blocks."""
        block = BLOCK_SIZE[self.qtype]
        if start % block or size % block:
            raise ValueError(f"{name}: a slice of inputs {start}..{start + size} splits its blocks of {block} "
                             f"({GGUF_TYPES[self.qtype]}); choose a tensor_parallel_size that divides "
                             f"{self.in_features} into multiples of {block}, or quantization='none'")
        per = BLOCK_BYTES[self.qtype]
        return QuantBlocks(self.data[:, start // block * per:(start + size) // block * per].contiguous(),
                           self.qtype, size)

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, in_features]: d * q (+ m), as llama.cpp (the gguf package's dequantizer); int8: scale * q."""
        if self.qtype == INT8:
            return self.data[:, 4:].view(torch.int8).float() * self.data[:, :4].contiguous().view(torch.float32)
        from gguf import dequantize
        return torch.from_numpy(dequantize(self.data.numpy(), self.qtype).reshape(self.shape).copy())


def same_type(a: QuantBlocks, b: QuantBlocks) -> tuple[QuantBlocks, QuantBlocks]:
    """Two parts of one merged weight in one type where that loses nothing (Q4_0 and Q5_0 beside Q8_0 become
    Q8_0); else as they are."""
    kinds = {a.qtype, b.qtype}
    if len(kinds) == 1 or 8 not in kinds or not kinds <= {8, 2, 6}:
        return a, b

    def q8(x: QuantBlocks) -> QuantBlocks:
        if x.qtype == 8:
            return x
        return QuantBlocks(torch.from_numpy(quant_kblocks.to_q8_0(x.data.numpy(), x.qtype)), 8, x.in_features)
    return q8(a), q8(b)


@dataclass(slots=True)
class MixedBlocks:
    """A merged weight whose parts come in types with no lossless common one (a Q4_K_M file's q and k in Q4_K
    beside v in Q6_K): runs of rows of one type each, in row order."""
    parts: list[QuantBlocks]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].in_features

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


def write_rows(blocks: "QuantBlocks | MixedBlocks", offset: int, src: QuantBlocks) -> "QuantBlocks | MixedBlocks":
    """A whole parameter's blocks with rows offset.. set to src: in place where the types agree (after
    same_type), else the rows split into runs of one type."""
    out, start, end = [], 0, offset + src.shape[0]
    for part in blocks.parts if isinstance(blocks, MixedBlocks) else [blocks]:
        stop = start + part.shape[0]
        lo, hi = max(offset, start), min(end, stop)
        if lo >= hi:
            out.append(part)
        else:
            part, piece = same_type(part, QuantBlocks(src.data[lo - offset:hi - offset], src.qtype, src.in_features))
            if part.qtype == piece.qtype:
                part.data[lo - start:hi - start] = piece.data
                out.append(part)
            else:
                out += [QuantBlocks(part.data[:lo - start], part.qtype, part.in_features), piece,
                        QuantBlocks(part.data[hi - start:], part.qtype, part.in_features)]
        start = stop
    runs = []
    for part in (p for p in out if p.shape[0]):
        if runs and runs[-1].qtype == part.qtype:
            runs[-1] = QuantBlocks(torch.cat([runs[-1].data, part.data]), part.qtype, part.in_features)
        else:
            runs.append(part)
    return runs[0] if len(runs) == 1 else MixedBlocks(runs)


def int8_blocks(w: torch.Tensor) -> QuantBlocks:
    """A dense weight [out, in] as int8 per output channel: scale = max |row| * (1/127), q = round(w / scale)."""
    scale, q = _symmetric(w.float(), w.shape[1])
    q = q.reshape(w.shape).to(torch.int8)
    data = torch.cat([scale.reshape(-1, 1).view(torch.uint8), q.view(torch.uint8)], dim=1)
    return QuantBlocks(data, INT8, w.shape[1])


@dataclass(slots=True)
class QuantWeight:
    """A weight packed for csrc/linear_q.c, and its logical shape."""
    data: torch.Tensor
    qtype: int
    out_features: int
    in_features: int


@dataclass(slots=True)
class QuantReference:
    """The torch reference of a quantized weight: dequantized, fp32 [out, in]."""
    weight: torch.Tensor
    qtype: int


@dataclass(slots=True)
class QuantParts:
    """MixedBlocks packed: each run of rows its own packed weight (QuantWeight or QuantReference), the outputs
    side by side."""
    parts: list
    out_features: int


FORMS = (QuantWeight, QuantReference, QuantParts)      # what quant_matmul runs


def type_name(packed) -> str:
    """"Q4_1"; for QuantParts its parts' types, "Q4_K+Q6_K"."""
    if isinstance(packed, QuantParts):
        return "+".join(sorted({type_name(p) for p in packed.parts}))
    return NAMES[packed.qtype]


def pack_blocks(blocks: "QuantBlocks | MixedBlocks"):
    """The form the matmul reads: the kernels' layout where they run, else the torch reference."""
    if isinstance(blocks, MixedBlocks):
        return QuantParts([pack_blocks(p) for p in blocks.parts], blocks.shape[0])
    kernels = cpu_kernels.active()
    if kernels is not None and blocks.qtype in kernels.quant_types:
        raw = blocks.data
        if blocks.qtype in quant_kblocks.BLOCK_SIZE:
            raw = torch.from_numpy(quant_kblocks.unpack(raw.numpy(), blocks.qtype))
        data = kernels.pack_quant_weight(raw, blocks.qtype, blocks.in_features)
        return QuantWeight(data, blocks.qtype, *blocks.shape)
    return QuantReference(blocks.dequantize(), blocks.qtype)


def _symmetric(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 x [..., k] in blocks of `block`: (scale per block, q as floats): scale = max |x| * (1/127),
    q = round-half-even(x * (1/scale)), csrc/linear_q.c's operations in its order."""
    blocks = x.reshape(*x.shape[:-1], -1, block)
    scale = blocks.abs().amax(-1, keepdim=True) * INV127
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return scale, torch.round(blocks * inverse)


def act_block(qtype: int) -> int:
    """The inputs per activation scale for a weight of qtype."""
    return INT8_BLOCK if qtype == INT8 else BLOCK


def round_activations(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """x [..., k] as csrc/linear_q.c quantizes it, in fp32: per row and block of `block` inputs (`act_block`; the
    last block of a row what is left of k), scale = max |x| * (1/127), q = round-half-even(x * (1/scale)), the
    value q * scale."""
    x, k = x.float(), x.shape[-1]
    whole = k - k % block
    rounded = []
    for part, size in ((x[..., :whole], block), (x[..., whole:], k - whole)):
        if size and part.shape[-1]:
            scale, q = _symmetric(part, size)
            rounded.append((q * scale).reshape(part.shape))
    return rounded[0] if len(rounded) == 1 else torch.cat(rounded, dim=-1)


def quant_matmul(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] @ w.T (+ bias) in x's dtype, with fp32 sums and one rounding at the end."""
    if isinstance(packed, QuantParts):
        outs, start = [], 0
        for part in packed.parts:
            n = part.out_features if isinstance(part, QuantWeight) else part.weight.shape[0]
            outs.append(quant_matmul(x, part, None if bias is None else bias[start:start + n]))
            start += n
        return torch.cat(outs, dim=-1)
    if isinstance(packed, QuantWeight):
        return cpu_kernels.load().linear_quant(x, packed.data, packed.qtype, packed.out_features, bias)
    y = F.linear(round_activations(x, act_block(packed.qtype)), packed.weight, None if bias is None else bias.float())
    return y.to(x.dtype)


def quant_embedding(ids: torch.Tensor, packed, dtype: torch.dtype) -> torch.Tensor:
    """Rows ids of a quantized weight (the embedding's lookup), dequantized into dtype."""
    if isinstance(packed, QuantWeight):
        rows = cpu_kernels.load().gather_quant_rows(packed.data, ids, packed.qtype, packed.out_features,
                                                    packed.in_features, dtype)
        return rows.view(*ids.shape, packed.in_features)
    return F.embedding(ids, packed.weight).to(dtype)
