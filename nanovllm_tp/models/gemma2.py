"""Gemma 2: GeGLU MLP (gelu, tanh approximation), RMSNorms that scale by (1 + weight), a norm before and after
both the attention and the MLP, embeddings times sqrt(hidden_size), attention scaled by query_pre_attn_scalar,
attention and final logits soft-capped, sliding-window and global layers alternating (layer_types)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from nanovllm_tp.layers.norm_rope_act import OffsetRMSNorm
from nanovllm_tp.models.blocks import CausalLM, DecoderAttention

if TYPE_CHECKING:     # annotations only: the config module reads architectures from this package
    from nanovllm_tp.config.engine_config import ModelConfig


class SandwichDecoderLayer(nn.Module):
    """x + post_attn(attn(input(x))), then + post_ff(mlp(pre_ff(.))). The running sum travels as `residual`:
    each pre-norm adds the previous block's output into it (RMSNorm's fused residual), each post-norm has none."""

    def __init__(self, cfg: ModelConfig, mlp: nn.Module, layer: int):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layer, norm=OffsetRMSNorm)
        self.mlp = mlp
        eps = cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


def gemma_options(hf_config) -> dict:
    """What Gemma 2 and 3 read alike; refuses bidirectional attention by name."""
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not implemented (causal attention only)")
    return {"hidden_act": getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh",
            "query_pre_attn_scalar": float(hf_config.query_pre_attn_scalar), "scale_embeddings": True,
            "attn_logit_softcap": float(getattr(hf_config, "attn_logit_softcapping", None) or 0.0),
            "final_logit_softcap": float(getattr(hf_config, "final_logit_softcapping", None) or 0.0)}


class Gemma2ForCausalLM(CausalLM):
    layer_class = SandwichDecoderLayer
    norm_class = OffsetRMSNorm

    @classmethod
    def config_options(cls, hf_config) -> dict:
        return {**super().config_options(hf_config), **gemma_options(hf_config)}
