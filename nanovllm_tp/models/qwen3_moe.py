"""Qwen3-MoE: Qwen3's attention (q/k norm) with a sparse MoE block in the layers the config names (every
decoder_sparse_step-th layer not in mlp_only_layers) and a dense gated MLP in the others."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from torch import nn

from nanovllm_tp.layers.weight_loading import RowRange
from nanovllm_tp.models.blocks import GatedMLP
from nanovllm_tp.models.moe import SparseMoE
from nanovllm_tp.models.qwen3 import Qwen3ForCausalLM

if TYPE_CHECKING:     # annotations only: the config module reads architectures from this package
    from nanovllm_tp.config.engine_config import ModelConfig

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_WHICH = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}
_STACKED = re.compile(r"\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.stacked$")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def config_options(cls, hf_config) -> dict:
        layers, step = hf_config.num_hidden_layers, getattr(hf_config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0)
        if getattr(hf_config, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act={hf_config.hidden_act!r}: the MoE experts implement silu only")
        if getattr(hf_config, "shared_expert_intermediate_size", 0):
            raise ValueError("shared_expert_intermediate_size: shared experts are not implemented")
        return {**super().config_options(hf_config), "num_experts": experts,
                "num_experts_per_tok": hf_config.num_experts_per_tok,
                "moe_intermediate_size": hf_config.moe_intermediate_size,
                "norm_topk_prob": bool(hf_config.norm_topk_prob),
                "moe_layers": tuple(i for i in range(layers) if i not in dense and experts and (i + 1) % step == 0)}

    @staticmethod
    def make_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
        if layer in cfg.moe_layers:
            return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                             cfg.norm_topk_prob)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, act=cfg.hidden_act)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.expert_rows = {"gate_proj": cfg.moe_intermediate_size, "up_proj": cfg.moe_intermediate_size,
                            "down_proj": cfg.hidden_size}
        self.num_experts = cfg.num_experts

    def checkpoint_parts(self, name: str, loaded):
        """A GGUF file's stacked experts of one layer ([experts * rows, columns]), one expert at a time."""
        if m := _STACKED.search(name):
            rows = self.expert_rows[m[1]]
            for expert in range(self.num_experts):
                yield f"{name[:m.start()]}.mlp.experts.{expert}.{m[1]}.weight", RowRange(loaded, expert * rows, rows)
            return
        yield name, loaded

    def checkpoint_target(self, name: str) -> tuple[str, tuple]:
        if m := _EXPERT.search(name):
            param = "w2" if m[2] == "down_proj" else "w13"
            return f"{name[:m.start()]}.mlp.experts.{param}", (int(m[1]), _WHICH[m[2]])
        return super().checkpoint_target(name)
