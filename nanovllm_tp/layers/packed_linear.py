"""The matmul of a CPU linear layer, and the packed weight forms it reads.

On CPU, once loaded, weights are repacked for the matmul that reads them (`pack_cpu_weights`): into the layout of
the C kernels in csrc/linear.c (bf16 with AVX-512 BF16, fp32 with AVX-512F), into oneDNN's blocked layout
(F.linear reorders the weight on every call, a packed weight is read as it is; oneDNN takes AMX tiles where the
CPU has them), or both. fp32 sums then come in the kernel's order (each output's sum over k in order) rather than
the BLAS order transformers uses, so a greedy token can flip at a near tie. The engine's packed_linear knob picks:
auto (the default) the faster of the two per weight shape and row-count bucket, measured on this CPU and cached
(kernel_choice.py, where both are registered as candidates), c+onednn the table an AMX CPU measures forced on
any CPU (csrc/linear.c up to 8 rows, oneDNN from 9), c csrc/linear.c wherever it runs (oneDNN elsewhere), bf16 csrc/linear.c for bf16 weights only (fp32 in the BLAS order), onednn oneDNN for both dtypes
(vLLM's CPU build uses oneDNN too), off F.linear everywhere. Quantized weights (GGUF blocks, or int8) are packed
for csrc/linear_q.c whatever packed_linear says.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm_tp.layers import cpu_kernels, kernel_choice, quant
from nanovllm_tp.layers.kernel_choice import ChosenWeight
from nanovllm_tp.layers.quant import QuantParts, QuantReference, QuantWeight


PACK_BATCH_HINT = 32     # the row count oneDNN picks the packed layout for (a decode batch); any count works


@dataclass(slots=True)
class BlockedWeight:
    """A weight packed for csrc/linear.c (bf16 or fp32), and its logical shape."""
    data: torch.Tensor
    out_features: int
    in_features: int


def packable_dtypes(mode: str) -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN packs under `mode` (the packed_linear knob)."""
    if mode == "off" or not torch.backends.mkldnn.is_available():
        return ()
    bf16 = (torch.bfloat16,) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else ()
    return bf16 + ((torch.float32,) if mode != "bf16" else ())


def _c_runs(w) -> bool:
    kernels = cpu_kernels.active()
    return (isinstance(w, torch.Tensor) and w.device.type == "cpu" and kernels is not None
            and w.dtype in kernels.linear_dtypes and (w.dtype is torch.float32 or w.shape[1] % 2 == 0))


def _onednn_runs(w) -> bool:
    return isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.dtype in packable_dtypes("onednn")


C_KERNEL = kernel_choice.register(
    "c", _c_runs, lambda w: BlockedWeight(cpu_kernels.load().pack_linear_weight(w), *w.shape),
    lambda x, p, bias: cpu_kernels.load().linear(x, p.data, p.out_features, bias))
ONEDNN = kernel_choice.register(
    "onednn", _onednn_runs, lambda w: torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_BATCH_HINT),
    lambda x, p, bias: torch.ops.mkldnn._linear_pointwise(x, p, bias, "none", [], ""))


def pack_weight(w: torch.Tensor, mode: str):
    """The packed form `matmul` reads for a CPU weight [out, in] under a forcing `mode` of the packed_linear knob
    (c, bf16, onednn, off; auto packs through kernel_choice.choose), or None (F.linear on the weight as it is)."""
    if mode == "off" or w.device.type != "cpu":
        return None
    if (mode == "c" or (mode == "bf16" and w.dtype is torch.bfloat16)) and _c_runs(w):
        return C_KERNEL.pack(w)
    if w.dtype in packable_dtypes(mode):
        return ONEDNN.pack(w)
    return None


def pack_cpu_weights(model: nn.Module, mode: str, int8: bool = False, row_invariant: bool = False) -> int:
    """Pack the weight of every layer that has a `packed` slot (linear layers, the LM head, the embedding):
    block-quantized weights for csrc/linear_q.c (or its torch reference: `quant.pack_blocks`), dense ones where
    `pack_weight` has a form for them (not the embedding's, looked up as it is), or with int8 quantized to int8
    per output channel first (whole blocks of 32 inputs only). A weight two layers share is packed once. What the
    packed form replaces is freed: a quantized weight's blocks, a linear layer's dense copy (the LM head's dense
    weight may be the embedding's too: kept). Returns how many layers were packed."""
    count, done = 0, {}
    dense = {id(m.weight): m.weight for m in model.modules() if hasattr(m, "packed") and m.packs_dense
             and getattr(m.weight, "blocks", None) is None and not (int8 and m.weight.shape[1] % quant.BLOCK == 0)}
    # auto: every dense weight's kernels chosen together, each shape timed on its layers' own weights
    fixed = kernel_choice.AMX_TABLE if mode == "c+onednn" else None
    chosen = (kernel_choice.choose([w for w in dense.values() if w.is_cpu], row_invariant, fixed)
              if mode in ("auto", "c+onednn") else {})
    for m in model.modules():
        if not hasattr(m, "packed"):
            continue
        w = m.weight
        blocks = getattr(w, "blocks", None)
        if id(w) in done:
            packed = done[id(w)]
        elif blocks is not None:
            packed = quant.pack_blocks(blocks)
        elif not m.packs_dense:
            continue
        elif id(w) not in dense:
            packed = quant.pack_blocks(quant.int8_blocks(w))
        else:
            packed = chosen[id(w)] if id(w) in chosen else pack_weight(w, mode)
        if packed is None:
            continue
        m.packed = done[id(w)] = packed
        if blocks is not None or getattr(m, "frees_dense", False):
            w.blocks = None
            w.data = w.data.new_empty((0, w.shape[1]))
        count += 1
    return count


def _path(packed) -> str:
    if isinstance(packed, QuantParts):
        return "+".join(_path(p) for p in packed.parts)
    if isinstance(packed, QuantWeight):
        return quant.type_name(packed).lower()
    if isinstance(packed, QuantReference):
        return quant.type_name(packed).lower() + "-torch"
    if isinstance(packed, ChosenWeight):
        return "+".join(packed.choice.kept())
    return "c" if isinstance(packed, BlockedWeight) else "torch" if packed is None else "onednn"


def linear_paths(model: nn.Module) -> str:
    """Which matmuls the model's linear layers (and LM head) run: "c" (csrc/linear.c), "onednn", "torch"
    (F.linear), a GGUF type in lower case ("q4_1": csrc/linear_q.c; "q4_1-torch": its torch reference)."""
    kinds = {kind for m in model.modules() if hasattr(m, "packed") and m.packs_dense
             for kind in _path(m.packed).split("+")}
    return "+".join(sorted(kinds)) or "torch"


def quantization_of(model: nn.Module) -> str:
    """The quantized types the model's weights run in ("Q4_1+Q8_0"), or "none"."""
    kinds = {kind for m in model.modules() if isinstance(getattr(m, "packed", None), quant.FORMS)
             for kind in quant.type_name(m.packed).split("+")}
    return "+".join(sorted(kinds)) or "none"


def matmul(x: torch.Tensor, weight: torch.Tensor, packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): through the packed weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    if x.dim() == 2 and isinstance(packed, quant.FORMS):      # the usual case, without reshapes
        return quant.quant_matmul(x, packed, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(packed, ChosenWeight):
        y = packed(x2, bias)
    elif isinstance(packed, BlockedWeight):
        y = C_KERNEL.run(x2, packed, bias)
    elif isinstance(packed, quant.FORMS):
        y = quant.quant_matmul(x2, packed, bias)
    else:
        y = ONEDNN.run(x2, packed, bias)
    return y.view(*x.shape[:-1], y.shape[-1])
