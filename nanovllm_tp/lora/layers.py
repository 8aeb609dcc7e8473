"""Every rank's LoRA slot tables and the batched low-rank matmul.

Each adapted linear layer (q/k/v packed in qkv_proj, gate/up in gate_up_proj, o_proj, down_proj) gets a
`LoRALayer`: A [slots, parts * R, in] and B [slots, parts * R, out] (B^T) for this rank's shard, R =
max_lora_rank, the parts of a packed layer side by side (B block-diagonal), the adapter's scale folded into B. An
adapter is sliced as its base layer is:
a column-parallel layer keeps A whole and the rows of B its own weight keeps (its weight_loader copies them);
a row-parallel layer keeps the columns of A its weight keeps and B whole, and its partial sums are reduced by
the base layer's all-reduce. So y += (x A_s^T) B_s^T for the slot s of each token's row, before that reduce.

`LoRABatch` is the step's mapping of tokens to slots, shared by every LoRA layer: on CPU with the kernels on
(fp32 or bf16 activations) its `SlotGroups`, the adapted tokens ordered by slot, for csrc/lora.c: one call per
layer that reads each adapter in use once whatever the rows sharing it (decode rows, speculative verify rows,
short prompt chunks), so a step costs about one pass over those adapters; a slot with many tokens in the step
(a long prompt chunk), and every slot elsewhere, as contiguous runs of one slot, a matmul pair each. The slot
tables hold the adapters in `lora_dtype` (auto: the model's dtype); bf16 tables under fp32 activations halve the
bytes a step reads, every sum still in fp32. The kernel takes each layer's tables and the step's groups as
csrc/lora.h's structs (`LoRATables`, built once a layer; `SlotGroups.desc`, once a step), the same ones the
fused decode layers (models/fused_decode.py) hand to csrc/decoder.c, which adds the deltas with the same call.
"""
import ctypes
import itertools
from ctypes import c_int32, c_int64, c_void_p
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm_tp.distributed.parallel_state import tp_size
from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm_tp.lora.peft_dir import load_tensors

# our module name -> the HF modules it holds, with the shard id its weight_loader takes
_PACKED = {"qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
           "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
           "o_proj": (("o_proj", None),), "down_proj": (("down_proj", None),)}
# a slot with more tokens than this in a step (a long prompt chunk) runs as torch matmuls: past it they are faster
# than csrc/lora.c at SmolLM2's shapes (equal at 16 tokens, 0.6x the kernel's time at 256)
KERNEL_TOKENS_PER_SLOT = 16


class LoRATables(ctypes.Structure):
    """csrc/lora.h's lora_tables: one layer's slot tables (the tensors must outlive it)."""
    _fields_ = [("A", c_void_p), ("B", c_void_p), ("ranks", c_void_p), ("part_rows", c_void_p), ("fan_in", c_int64),
                ("fan_out", c_int64), ("rank", c_int64), ("parts", c_int32), ("bf16", c_int32)]

    @classmethod
    def of(cls, A: torch.Tensor, B: torch.Tensor, ranks: torch.Tensor, part_rows: torch.Tensor, rank: int):
        """A [slots, parts * rank, in], B [slots, parts * rank, out] (fp32 or bf16, contiguous), `ranks` [slots,
        parts] and `part_rows` [parts + 1] int64 (see csrc/lora.c)."""
        if not (A.is_contiguous() and B.is_contiguous() and ranks.is_contiguous() and A.dtype is B.dtype):
            raise ValueError("LoRA slot tables must be contiguous and of one dtype")
        return cls(A.data_ptr(), B.data_ptr(), ranks.data_ptr(), part_rows.data_ptr(), A.shape[2], B.shape[2], rank,
                   ranks.shape[1], int(A.dtype is torch.bfloat16))


class GroupsDesc(ctypes.Structure):
    """csrc/lora.h's lora_groups: a SlotGroups' tensors."""
    _fields_ = [("order", c_void_p), ("starts", c_void_p), ("slots", c_void_p), ("groups", c_int64)]


@dataclass(slots=True)
class SlotGroups:
    """A step's adapted tokens grouped by slot, as csrc/lora.c takes them (int64 tensors): the tokens in slot
    order (`order`), where each slot's tokens begin in it (`starts`, one more than the slots), the slots; `desc`
    the struct that points at them."""
    order: torch.Tensor
    starts: torch.Tensor
    slots: torch.Tensor
    desc: GroupsDesc = None

    def __post_init__(self):
        self.desc = GroupsDesc(self.order.data_ptr(), self.starts.data_ptr(), self.slots.data_ptr(), len(self.slots))

    @classmethod
    def of(cls, token_slots: np.ndarray) -> "SlotGroups":
        """token_slots: each token's slot, -1 for the base model's tokens (left out)."""
        adapted = np.flatnonzero(token_slots >= 0)
        order = adapted[np.argsort(token_slots[adapted], kind="stable")]
        ordered = token_slots[order]
        starts = np.concatenate(([0], np.flatnonzero(np.diff(ordered)) + 1, [len(order)])) if len(order) else \
            np.zeros(1, np.int64)
        return cls(torch.from_numpy(order.astype(np.int64)), torch.from_numpy(starts.astype(np.int64)),
                   torch.from_numpy(ordered[starts[:-1]].astype(np.int64)))


class LoRABatch:
    """The step's tokens by slot: `runs` (slot, start, end), every run of one slot; where the C kernel runs
    (`kernel`: fp32 or bf16 on CPU with the kernels on) `groups`, the SlotGroups of the slots with at most
    KERNEL_TOKENS_PER_SLOT tokens, and `heavy`, the runs of the others (long prompt chunks: a matmul pair each is
    faster there); nothing when no row has an adapter."""
    __slots__ = ("runs", "groups", "heavy", "kernel")

    def __init__(self, kernel: bool):
        self.runs: list[tuple[int, int, int]] = []
        self.heavy: list[tuple[int, int, int]] = []
        self.groups: SlotGroups | None = None
        self.kernel = kernel

    def set(self, lora_slot, cu_seqlens_q) -> None:
        self.runs, self.heavy, self.groups = [], [], None
        if lora_slot is None:
            return
        slots, cu = lora_slot.tolist(), cu_seqlens_q.tolist()
        runs = []
        for row, slot in enumerate(slots):
            if runs and runs[-1][0] == slot and runs[-1][2] == cu[row]:
                runs[-1][2] = cu[row + 1]
            else:
                runs.append([slot, cu[row], cu[row + 1]])
        self.runs = [tuple(r) for r in runs if r[0] >= 0]
        if self.kernel:
            token_slots = np.repeat(np.asarray(lora_slot, np.int64), np.diff(cu_seqlens_q))
            counts = np.bincount(token_slots[token_slots >= 0])
            heavy = np.flatnonzero(counts > KERNEL_TOKENS_PER_SLOT)
            if len(heavy):
                self.heavy = [r for r in self.runs if r[0] in set(heavy.tolist())]
                token_slots = np.where(np.isin(token_slots, heavy), -1, token_slots)
            self.groups = SlotGroups.of(token_slots)


class LoRALayer:
    __slots__ = ("base", "parts", "batch", "row_parallel", "rank", "A", "B", "ranks", "part_rows", "tables")

    def __init__(self, base: LinearBase, parts, batch: LoRABatch, num_slots: int, max_rank: int, dtype=None):
        """dtype: the slot tables' (None: the base weight's)."""
        out, fan_in = base.weight.shape
        w = base.weight
        dtype = dtype or w.dtype
        self.base, self.parts, self.batch, self.rank = base, parts, batch, max_rank
        self.row_parallel = isinstance(base, RowParallelLinear)
        width = len(parts) * max_rank
        self.A = torch.zeros(num_slots, width, fan_in, dtype=dtype, device=w.device)
        self.B = torch.zeros(num_slots, width, out, dtype=dtype, device=w.device)
        self.ranks = torch.zeros(num_slots, len(parts), dtype=torch.int64)   # each slot's rank per part (C)
        if isinstance(base, QKVParallelLinear):
            sizes = [base.num_heads * base.head_dim] + [base.num_kv_heads * base.head_dim] * 2
        elif isinstance(base, MergedColumnParallelLinear):
            sizes = [s // tp_size() for s in base.output_sizes]
        else:
            sizes = [out]
        self.part_rows = torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int64)
        self.tables = LoRATables.of(self.A, self.B, self.ranks, self.part_rows, max_rank)   # loads write in place

    def full_shape(self, part: int) -> tuple[int, int]:
        """(in_features, out_features) of one HF module of this layer, whole (as the adapter holds it)."""
        base, tp = self.base, tp_size()
        fan_in = self.A.shape[2] * (tp if self.row_parallel else 1)
        shard = self.parts[part][1]
        if isinstance(base, QKVParallelLinear):
            heads = base.num_heads * tp if shard == "q" else base.num_kv_heads * tp // base.kv_replicas
            return fan_in, heads * base.head_dim
        if isinstance(base, MergedColumnParallelLinear):
            return fan_in, base.output_sizes[shard]
        return fan_in, self.B.shape[2] * (1 if self.row_parallel else tp)

    def clear(self, slot: int) -> None:
        self.A[slot].zero_()
        self.B[slot].zero_()
        self.ranks[slot] = 0

    def load(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """One HF module's A [r, in] and B [out, r], whole, into this rank's share of the slot."""
        r, shard = a.shape[0], self.parts[part][1]
        cols = slice(part * self.rank, part * self.rank + r)
        self.ranks[slot, part] = r
        if self.row_parallel:
            mine = torch.empty(r, self.A.shape[2], dtype=self.A.dtype)
            self.base.weight_loader(mine, a)            # this rank's input columns, as the base weight's
            self.A[slot, cols] = mine
            self.B[slot, cols] = (b * scale).T
            return
        self.A[slot, cols] = a
        rows = torch.zeros(self.B.shape[2], r, dtype=self.B.dtype)
        self.base.weight_loader(rows, b * scale, *(() if shard is None else (shard,)))   # this rank's rows
        self.B[slot, cols] = rows.T

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (this rank's x @ W^T, before any reduce) plus each row's adapter delta."""
        batch, runs = self.batch, self.batch.runs
        if batch.groups is not None and x.dtype == y.dtype:
            kernels = cpu_kernels.active()
            if kernels is not None:
                kernels.lora_apply(self.tables, batch.groups, x, y)
                runs = batch.heavy
        for slot, start, end in runs:
            a, b = self.A[slot], self.B[slot]
            if a.dtype == y.dtype:
                y[start:end].addmm_(x[start:end] @ a.T, b)
            else:       # lora_dtype apart from the model's: the sums in fp32, y rounded once
                rows = y[start:end]
                rows.copy_(torch.addmm(rows.float(), x[start:end].float() @ a.float().T, b.float()))
        return y


class LoRAModel:
    """A model's LoRA layers on this rank, and the HF names of the modules they adapt."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, lora_dtype: str = "auto"):
        w = next(model.parameters())
        dtype = w.dtype if lora_dtype == "auto" else getattr(torch, lora_dtype)
        self.batch = LoRABatch(w.dtype in cpu_kernels.DTYPES and dtype in cpu_kernels.DTYPES and w.is_cpu and
                               cpu_kernels.active() is not None)
        self.where: dict[str, tuple[LoRALayer, int]] = {}        # HF module name -> (layer, part)
        for name, module in model.named_modules():
            prefix, _, ours = name.rpartition(".")
            if ours not in _PACKED or not isinstance(module, LinearBase):
                continue
            layer = module.lora = LoRALayer(module, _PACKED[ours], self.batch, max_loras, max_rank, dtype)
            for part, (piece, _) in enumerate(layer.parts):
                self.where[f"{prefix}.{piece}"] = (layer, part)
        self.layers = list({id(layer): layer for layer, _ in self.where.values()}.values())

    def slot_bytes(self) -> list[int]:
        """Per slot, the bytes of its adapter that a step with its rows reads on this rank (A's and B's rank
        rows over the inputs and each part's outputs)."""
        total = torch.zeros(self.layers[0].ranks.shape[0], dtype=torch.int64) if self.layers else torch.zeros(0)
        for layer in self.layers:
            widths = layer.A.shape[2] + layer.part_rows.diff()
            total += (layer.ranks * widths).sum(1) * layer.A.element_size()
        return total.tolist()

    def targets(self) -> dict[str, tuple[int, int]]:
        """HF module name -> (in_features, out_features) whole: what read_adapter checks an adapter against."""
        return {name: layer.full_shape(part) for name, (layer, part) in self.where.items()}

    def load(self, slot: int, path: str) -> None:
        scale, pairs = load_tensors(path)
        for layer in self.layers:
            layer.clear(slot)
        for module, (a, b) in pairs.items():
            layer, part = self.where[module]
            layer.load(slot, part, a, b, scale)

    def prepare(self, plan) -> None:
        """The plan's adapter loads, then its rows' slots."""
        for slot, _, path in plan.lora_loads or ():
            self.load(slot, path)
        self.batch.set(plan.lora_slot, plan.cu_seqlens_q)
