"""Sparse mixture-of-experts block: a replicated router picks top-k experts per token; every rank holds a slice
of every expert's intermediate dimension (gate/up rows, down columns), so one all-reduce per layer sums both the
slices and the experts.

Tokens are grouped by expert (a stable sort of the flattened top-k choices), then each active expert runs one
matmul over its tokens: a Python loop over experts, never over tokens. The expert counts are read on the host,
so MoE models run without CUDA graphs (EngineConfig sets enforce_eager).
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm_tp.distributed.parallel_state import all_reduce, tp_rank, tp_size
from nanovllm_tp.layers.linear import ReplicatedLinear
from nanovllm_tp.layers.norm_rope_act import SiluAndMul
from nanovllm_tp.layers.weight_loading import copy_checked, take_cols, take_rows


class ExpertWeights(nn.Module):
    """w13 [experts, 2 * local_intermediate, hidden] (gate rows, then up rows) and w2 [experts, hidden,
    local_intermediate]; checkpoints store each expert's gate_proj / up_proj / down_proj separately."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        if intermediate_size % tp_size():
            raise ValueError(f"moe_intermediate_size {intermediate_size} is not divisible by "
                             f"tensor_parallel_size={tp_size()}")
        self.local = intermediate_size // tp_size()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.local, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.local), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, expert: int, which: int = 0) -> None:
        """which: 0 gate_proj, 1 up_proj (rows of w13), 2 down_proj (w2)."""
        start = tp_rank() * self.local
        if which == 2:
            copy_checked(param.data[expert], take_cols(loaded, start, self.local), f"expert {expert} down_proj")
        else:
            dst = param.data[expert, which * self.local:(which + 1) * self.local]
            copy_checked(dst, take_rows(loaded, start, self.local), f"expert {expert} gate/up_proj")


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.experts = ExpertWeights(num_experts, hidden_size, intermediate_size)
        self.act = SiluAndMul()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids [tokens, k] and their weights: softmax over all experts in fp32, then (if the
        config says so) the k chosen probabilities renormalised to sum to one."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        token_of, weight_of = order // self.top_k, weights.flatten()[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        w13, w2 = self.experts.w13, self.experts.w2
        start = 0
        for expert, n in enumerate(counts):
            if n:
                rows = token_of[start:start + n]
                h = F.linear(self.act(F.linear(x[rows], w13[expert])), w2[expert])
                out.index_add_(0, rows, h * weight_of[start:start + n, None])
                start += n
        return all_reduce(out)
