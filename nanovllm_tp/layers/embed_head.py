"""Vocab-parallel embedding and LM head. The vocab is padded up to a multiple of the TP size."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm_tp.distributed.parallel_state import all_reduce, gather_last_dim_to_rank0, tp_rank, tp_size
from nanovllm_tp.layers.packed_linear import matmul
from nanovllm_tp.layers.quant import quant_embedding
from nanovllm_tp.layers.weight_loading import load_rows, shape_of, take_rows
from nanovllm_tp.utils.context import get_context


class VocabParallelEmbedding(nn.Module):
    packed = None            # a quantized weight's packed form (shared with a tied LM head), once pack_cpu_weights ran
    packs_dense = False      # a dense weight is looked up as it is

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp_size())
        self.start = tp_rank() * self.shard_size
        self.end = min(self.start + self.shard_size, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded):
        rows = self.end - self.start
        if shape_of(loaded)[0] != self.vocab_size:
            raise ValueError(f"checkpoint vocab has {shape_of(loaded)[0]} rows, config says {self.vocab_size}")
        load_rows(param, 0, take_rows(loaded, self.start, rows))
        param.data[rows:] = 0     # padding rows of the last shard

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.embedding(ids, self.weight)
        return quant_embedding(ids, self.packed, self.weight.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return self.lookup(input_ids)
        in_shard = (input_ids >= self.start) & (input_ids < self.end)
        y = self.lookup((input_ids - self.start) * in_shard)
        return all_reduce(y * in_shard.unsqueeze(-1).to(y.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the last token of each row (or the tokens the context names), gathered whole on rank 0
    (None elsewhere)."""
    packed = None            # the weight packed for the matmul, once pack_cpu_weights ran
    packs_dense = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        ctx = get_context()
        if ctx.logits_indices is not None:
            hidden = hidden[ctx.logits_indices]
        elif ctx.is_prefill:
            hidden = hidden[ctx.cu_seqlens_q[1:] - 1]
        logits = gather_last_dim_to_rank0(matmul(hidden, self.weight, self.packed))
        return logits[:, :self.vocab_size] if logits is not None else None
