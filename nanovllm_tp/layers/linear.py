"""Tensor-parallel linear layers: column-parallel (outputs split across ranks), row-parallel (inputs split, partial
sums all-reduced), and their merged forms (gate and up; q, k and v). Each weight's loader copies this rank's slice
(weight_loading.py); the forward is packed_linear.matmul, through the weight's packed form on CPU.
"""
import torch
from torch import nn

from nanovllm_tp.distributed.parallel_state import all_reduce, tp_rank, tp_size
from nanovllm_tp.layers.packed_linear import matmul
from nanovllm_tp.layers.weight_loading import default_weight_loader, load_rows, take_cols, take_rows


class LinearBase(nn.Module):
    packed = None            # the weight packed for the matmul, once pack_cpu_weights ran
    packs_dense = True
    frees_dense = True       # its dense weight is dropped once packed (the LM head's may be the embedding's: kept)
    lora = None              # its lora.layers.LoRALayer with enable_lora: adds each row's adapter delta

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded, *shard) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul(x, self.weight, self.packed, self.bias)
        return y if self.lora is None else self.lora.apply(x, y)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        if out_features % tp_size():
            raise ValueError(f"output size {out_features} is not divisible by tensor_parallel_size={tp_size()}")
        super().__init__(in_features, out_features // tp_size(), bias)

    def weight_loader(self, param, loaded, *shard):
        size = param.shape[0]
        load_rows(param, 0, take_rows(loaded, tp_rank() * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up); loaded one source tensor at a time."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param, loaded, shard_id: int):
        local = [s // tp_size() for s in self.output_sizes]
        offset = sum(local[:shard_id])
        load_rows(param, offset, take_rows(loaded, tp_rank() * local[shard_id], local[shard_id]))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul. kv heads are replicated when tp exceeds their count."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)    # ranks sharing one kv head
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param, loaded, shard_id: str):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q_size, tp_rank() * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, (tp_rank() // self.kv_replicas) * kv_size
        load_rows(param, offset, take_rows(loaded, start, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums all-reduced, bias added once after."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        if in_features % tp_size():
            raise ValueError(f"input size {in_features} is not divisible by tensor_parallel_size={tp_size()}")
        super().__init__(in_features // tp_size(), out_features, bias)

    def weight_loader(self, param, loaded, *shard):
        if param.dim() == 1:     # bias is not split
            return super().weight_loader(param, loaded)
        size = param.shape[1]
        load_rows(param, 0, take_cols(loaded, tp_rank() * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul(x, self.weight, self.packed)
        y = all_reduce(y if self.lora is None else self.lora.apply(x, y))     # partial deltas reduced with y
        return y + self.bias if self.bias is not None else y
