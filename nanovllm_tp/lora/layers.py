"""Every rank's LoRA slot tables and the batched low-rank matmul.

Each adapted linear layer (q/k/v packed in qkv_proj, gate/up in gate_up_proj, o_proj, down_proj) gets a
`LoRALayer`: A [slots, parts * R, in] and B [slots, parts * R, out] (B^T) for this rank's shard, R =
max_lora_rank, the parts of a packed layer side by side (B block-diagonal), the adapter's scale folded into B. An
adapter is sliced as its base layer is:
a column-parallel layer keeps A whole and the rows of B its own weight keeps (its weight_loader copies them);
a row-parallel layer keeps the columns of A its weight keeps and B whole, and its partial sums are reduced by
the base layer's all-reduce. So y += (x A_s^T) B_s^T for the slot s of each token's row, before that reduce.

`LoRABatch` is the step's mapping of tokens to slots, shared by every LoRA layer: contiguous runs of one slot, a
matmul pair each (torch: long prompt chunks, other devices), and on CPU in fp32 or bf16 for steps of few tokens
a run (decode, speculative verify, a prompt's last token after a prefix-cache hit) each token's slot for
csrc/lora.c, one call per layer that reads only the rank rows and columns of each token's adapter. Measured
at SmolLM2's shapes, 30 layers, 8 rows of 8 rank-16 adapters, one thread: 18 ms a step in C against 107 ms for
the runs and 284 ms for a gathered torch form (index_select of the slot tables, bmm pair), since dropped.
"""
import itertools

import numpy as np
import torch

from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm_tp.distributed.parallel_state import tp_size
from nanovllm_tp.lora.peft_dir import load_tensors

# our module name -> the HF modules it holds, with the shard id its weight_loader takes
_PACKED = {"qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
           "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
           "o_proj": (("o_proj", None),), "down_proj": (("down_proj", None),)}
KERNEL_TOKENS_PER_RUN = 8     # C kernel up to this many tokens a run: it reads a token's adapter once per token


class LoRABatch:
    """The step's tokens by slot: `runs` (slot, start, end), and for decode steps where the C kernel may run
    (`kernel`: fp32 on CPU with the kernels on) `slots`, each token's slot (-1: base); nothing when no row has an
    adapter."""
    __slots__ = ("runs", "slots", "kernel")

    def __init__(self, kernel: bool):
        self.runs: list[tuple[int, int, int]] = []
        self.slots = None
        self.kernel = kernel

    def set(self, lora_slot, cu_seqlens_q) -> None:
        self.runs, self.slots = [], None
        if lora_slot is None:
            return
        slots, cu = lora_slot.tolist(), cu_seqlens_q.tolist()
        runs = []
        for row, slot in enumerate(slots):
            if runs and runs[-1][0] == slot and runs[-1][2] == cu[row]:
                runs[-1][2] = cu[row + 1]
            else:
                runs.append([slot, cu[row], cu[row + 1]])
        if self.kernel and cu[-1] <= KERNEL_TOKENS_PER_RUN * len(runs):
            self.slots = torch.from_numpy(np.repeat(np.asarray(lora_slot, np.int64), np.diff(cu_seqlens_q)))
        self.runs = [tuple(r) for r in runs if r[0] >= 0]


class LoRALayer:
    __slots__ = ("base", "parts", "batch", "row_parallel", "rank", "A", "B", "ranks", "part_rows")

    def __init__(self, base: LinearBase, parts, batch: LoRABatch, num_slots: int, max_rank: int):
        out, fan_in = base.weight.shape
        w = base.weight
        self.base, self.parts, self.batch, self.rank = base, parts, batch, max_rank
        self.row_parallel = isinstance(base, RowParallelLinear)
        width = len(parts) * max_rank
        self.A = torch.zeros(num_slots, width, fan_in, dtype=w.dtype, device=w.device)
        self.B = torch.zeros(num_slots, width, out, dtype=w.dtype, device=w.device)
        self.ranks = torch.zeros(num_slots, len(parts), dtype=torch.int64)   # each slot's rank per part (C)
        if isinstance(base, QKVParallelLinear):
            sizes = [base.num_heads * base.head_dim] + [base.num_kv_heads * base.head_dim] * 2
        elif isinstance(base, MergedColumnParallelLinear):
            sizes = [s // tp_size() for s in base.output_sizes]
        else:
            sizes = [out]
        self.part_rows = torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int64)

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
        batch = self.batch
        if batch.slots is not None:
            kernels = cpu_kernels.active()
            if kernels is not None and x.dtype == y.dtype == self.A.dtype and y.stride(-1) == 1:
                kernels.lora_gathered(x, y, self.A, self.B, batch.slots, self.ranks, self.part_rows, self.rank)
                return y
        for slot, start, end in batch.runs:
            y[start:end].addmm_(x[start:end] @ self.A[slot].T, self.B[slot])
        return y


class LoRAModel:
    """A model's LoRA layers on this rank, and the HF names of the modules they adapt."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int):
        w = next(model.parameters())
        self.batch = LoRABatch(w.dtype in cpu_kernels.DTYPES and w.is_cpu and cpu_kernels.active() is not None)
        self.where: dict[str, tuple[LoRALayer, int]] = {}        # HF module name -> (layer, part)
        for name, module in model.named_modules():
            prefix, _, ours = name.rpartition(".")
            if ours not in _PACKED or not isinstance(module, LinearBase):
                continue
            layer = module.lora = LoRALayer(module, _PACKED[ours], self.batch, max_loras, max_rank)
            for part, (piece, _) in enumerate(layer.parts):
                self.where[f"{prefix}.{piece}"] = (layer, part)
        self.layers = list({id(layer): layer for layer, _ in self.where.values()}.values())

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
