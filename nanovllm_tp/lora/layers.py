"""Every rank's LoRA slot tables and the batched low-rank matmul.

Each adapted linear layer (q/k/v packed in qkv_proj, gate/up in gate_up_proj, o_proj, down_proj) gets a
`LoRALayer`: A [slots + 1, parts * R, in] and B [slots + 1, out, parts * R] for this rank's shard, R =
max_lora_rank, the parts of a packed layer side by side (B block-diagonal), the adapter's scale folded into B,
and a last slot of zeros that base rows read in the gathered form. An adapter is sliced as its base layer is:
a column-parallel layer keeps A whole and the rows of B its own weight keeps (its weight_loader copies them);
a row-parallel layer keeps the columns of A its weight keeps and B whole, and its partial sums are reduced by
the base layer's all-reduce. So y += (x A_s^T) B_s^T for the slot s of each token's row, before that reduce.

`LoRABatch` is the step's mapping of tokens to slots, shared by every LoRA layer: contiguous runs of one slot
(a matmul pair each), or for decode steps of several adapters one gathered bmm pair over all rows.
"""
import torch

from nanovllm_tp.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm_tp.distributed.parallel_state import tp_size
from nanovllm_tp.lora.peft_dir import load_tensors

# our module name -> the HF modules it holds, with the shard id its weight_loader takes
_PACKED = {"qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
           "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
           "o_proj": (("o_proj", None),), "down_proj": (("down_proj", None),)}
GATHER_MIN_RUNS = 3     # decode steps with this many runs of one slot or more take the gathered form


class LoRABatch:
    """The step's tokens by slot: `runs` (slot, start, end), or `gathered` (each token's slot, base rows on the
    zero slot) for decode steps of several adapters; neither when no row has an adapter."""
    __slots__ = ("runs", "gathered")

    def __init__(self):
        self.runs: list[tuple[int, int, int]] = []
        self.gathered: torch.Tensor | None = None

    def set(self, lora_slot, cu_seqlens_q, zero_slot: int, device) -> None:
        self.runs, self.gathered = [], None
        if lora_slot is None:
            return
        slots, cu = lora_slot.tolist(), cu_seqlens_q.tolist()
        runs = []
        for row, slot in enumerate(slots):
            if runs and runs[-1][0] == slot and runs[-1][2] == cu[row]:
                runs[-1][2] = cu[row + 1]
            else:
                runs.append([slot, cu[row], cu[row + 1]])
        if len(runs) >= GATHER_MIN_RUNS and cu[-1] == len(slots):      # decode: one token per row
            self.gathered = torch.tensor([s if s >= 0 else zero_slot for s in slots], dtype=torch.int64,
                                         device=device)
        else:
            self.runs = [tuple(r) for r in runs if r[0] >= 0]


class LoRALayer:
    __slots__ = ("base", "parts", "batch", "row_parallel", "rank", "A", "B")

    def __init__(self, base: LinearBase, parts, batch: LoRABatch, num_slots: int, max_rank: int):
        out, fan_in = base.weight.shape
        w = base.weight
        self.base, self.parts, self.batch, self.rank = base, parts, batch, max_rank
        self.row_parallel = isinstance(base, RowParallelLinear)
        width = len(parts) * max_rank
        self.A = torch.zeros(num_slots + 1, width, fan_in, dtype=w.dtype, device=w.device)
        self.B = torch.zeros(num_slots + 1, out, width, dtype=w.dtype, device=w.device)

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
        return fan_in, self.B.shape[1] * (1 if self.row_parallel else tp)

    def clear(self, slot: int) -> None:
        self.A[slot].zero_()
        self.B[slot].zero_()

    def load(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """One HF module's A [r, in] and B [out, r], whole, into this rank's share of the slot."""
        r, shard = a.shape[0], self.parts[part][1]
        cols = slice(part * self.rank, part * self.rank + r)
        if self.row_parallel:
            mine = torch.empty(r, self.A.shape[2], dtype=self.A.dtype)
            self.base.weight_loader(mine, a)            # this rank's input columns, as the base weight's
            self.A[slot, cols] = mine
            self.B[slot, :, cols] = b * scale
            return
        self.A[slot, cols] = a
        rows = torch.zeros(self.B.shape[1], r, dtype=self.B.dtype)
        self.base.weight_loader(rows, b * scale, *(() if shard is None else (shard,)))   # this rank's rows
        self.B[slot, :, cols] = rows

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (this rank's x @ W^T, before any reduce) plus each row's adapter delta."""
        batch = self.batch
        if batch.gathered is not None:
            idx = batch.gathered
            h = torch.bmm(self.A.index_select(0, idx), x.unsqueeze(-1))
            return y.add_(torch.bmm(self.B.index_select(0, idx), h).squeeze(-1))
        for slot, start, end in batch.runs:
            y[start:end].addmm_(x[start:end] @ self.A[slot].T, self.B[slot].T)
        return y


class LoRAModel:
    """A model's LoRA layers on this rank, and the HF names of the modules they adapt."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int):
        self.batch = LoRABatch()
        self.zero_slot = max_loras
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

    def prepare(self, plan, device) -> None:
        """The plan's adapter loads, then its rows' slots."""
        for slot, _, path in plan.lora_loads or ():
            self.load(slot, path)
        self.batch.set(plan.lora_slot, plan.cu_seqlens_q, self.zero_slot, device)
