"""Shared building blocks of the decoder-only architectures: attention, gated MLP, decoder layer, the model
body and a causal-LM base class.

An architecture file subclasses `CausalLM`, says how it reads its HF config (`config_options`) and, if its
layers differ, which MLP each layer gets (`make_mlp`). Checkpoint names follow HF's (`model.layers.N...`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from nanovllm_tp.distributed.pipeline import pp_size, pp_stage
from nanovllm_tp.distributed.pp_partition import stage_layers
from nanovllm_tp.layers.attention import Attention
from nanovllm_tp.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm_tp.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm_tp.layers.norm_rope_act import GATED_ACTIVATIONS, RMSNorm, RotaryEmbedding

if TYPE_CHECKING:     # annotations only: the config module reads architectures from this package
    from nanovllm_tp.config.engine_config import ModelConfig


class DecoderAttention(nn.Module):
    """q/k/v projections, optional q/k norms (of class `norm`), RoPE, paged attention with the layer's window
    and the config's scale and logit cap, o projection."""

    def __init__(self, cfg: ModelConfig, layer: int, norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias=cfg.o_proj_bias)
        theta, scaling = cfg.layer_rope(layer)
        self.rotary_emb = RotaryEmbedding(d, cfg.max_position_embeddings, theta, scaling, cfg.rotary_dim)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, (cfg.query_pre_attn_scalar or d) ** -0.5,
                              window=cfg.layer_windows[layer], softcap=cfg.attn_logit_softcap)
        if cfg.qk_norm:
            self.q_norm = norm(d, cfg.rms_norm_eps)
            self.k_norm = norm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.head_dim = d

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v).flatten(1))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), act SiLU or GELU-tanh (the config's hidden_act); gate/up split by output
    features across ranks, down by input features."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu"):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act = GATED_ACTIVATIONS[act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: nn.Module, layer: int):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layer)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class MissingLayer(nn.Module):
    """Stands where a decoder layer of another pipeline stage would be: keeps the layers' indices (and so the
    checkpoint's names) of the stage's own, holds nothing, and is never called."""

    def forward(self, *args):
        raise RuntimeError("a decoder layer of another pipeline stage was called")


class DecoderModel(nn.Module):
    """The embedding, decoder layers and final norm; under pipeline parallelism only this rank's stage of them
    (`stage_layers`): the embedding on the first stage, the final norm on the last, MissingLayer elsewhere."""
    fused = None     # a models.fused_decode.FusedDecode (set by the runner): its C layers for the steps it runs

    def __init__(self, cfg: ModelConfig, make_mlp, layer_class: type[nn.Module] = DecoderLayer,
                 norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        stage, stages = pp_stage(), pp_size()
        self.first_stage, self.last_stage = stage == 0, stage == stages - 1
        self.stage_layers = stage_layers(cfg.num_hidden_layers, stage, stages)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if self.first_stage else None
        self.layers = nn.ModuleList(layer_class(cfg, make_mlp(cfg, i), i) if i in self.stage_layers
                                    else MissingLayer() for i in range(cfg.num_hidden_layers))
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps) if self.last_stage else None
        self.embed_scale = cfg.hidden_size ** 0.5 if cfg.scale_embeddings else None

    def own_layers(self) -> list[nn.Module]:
        return [self.layers[i] for i in self.stage_layers]

    def forward(self, input_ids, positions, carried=None):
        """The final hidden states, or on a stage before the last its (hidden, residual) for the next stage;
        `carried`: the previous stage's (hidden, residual) on a stage after the first."""
        if carried is None:
            hidden, residual = self.embed_tokens(input_ids), None
            if self.embed_scale is not None:      # Gemma: times sqrt(hidden_size), rounded to the activations' dtype
                hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        else:
            hidden, residual = carried
        if self.fused is not None and (out := self.fused(hidden, positions, residual)) is not None:
            hidden, residual = out
        else:
            for layer in self.own_layers():
                hidden, residual = layer(positions, hidden, residual)
        if not self.last_stage:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """The model interface the runner, loader and CUDA-graph runner use: forward(input_ids, positions) ->
    hidden states, compute_logits(hidden), hidden_size, tie_word_embeddings and checkpoint_target (checkpoint
    tensor name -> parameter name and weight_loader shard arguments)."""

    # checkpoint name piece -> (our parameter name piece, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def config_options(cls, hf_config) -> dict:
        """This architecture's reading of the HF config: ModelConfig fields beyond the common ones."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return {"attention_bias": bias, "o_proj_bias": bias, "qk_norm": False,
                "hidden_act": getattr(hf_config, "hidden_act", "silu")}

    layer_class: type[nn.Module] = DecoderLayer    # an architecture with other layers names its own
    norm_class: type[RMSNorm] = RMSNorm
    partial_rotary = False      # whether its attention honours a partial_rotary_factor (else refused by name)

    @staticmethod
    def make_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act)

    def checkpoint_parts(self, name: str, loaded):
        """(name, tensor) pieces of one checkpoint tensor: itself, unless the checkpoint fuses what the model
        loads apart (Phi-3's qkv_proj and gate_up_proj)."""
        yield name, loaded

    def checkpoint_target(self, name: str) -> tuple[str, tuple]:
        """The parameter a checkpoint tensor loads into, and the shard arguments of its weight_loader (a tied
        embedding loads the LM head of a last pipeline stage that holds no embedding)."""
        if name == "model.embed_tokens.weight" and self.tie_word_embeddings and not self.model.first_stage:
            return ("lm_head.weight" if self.model.last_stage else name), ()
        for piece, (ours, shard_id) in self.packed_modules.items():
            if f".{piece}." in name:
                return name.replace(f".{piece}.", f".{ours}."), (shard_id,)
        return name, ()

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.model = DecoderModel(cfg, self.make_mlp, self.layer_class, self.norm_class)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size) if self.model.last_stage else None
        self.final_logit_softcap = cfg.final_logit_softcap
        self.tie_word_embeddings = cfg.tie_word_embeddings
        if cfg.tie_word_embeddings and self.model.first_stage and self.model.last_stage:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, carried=None):
        return self.model(input_ids, positions, carried)

    def holds(self, name: str) -> bool:
        """Whether parameter `name` is on this rank's pipeline stage (a checkpoint tensor of another is skipped)."""
        body = self.model
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in body.stage_layers
        if name.startswith("model.embed_tokens."):
            return body.first_stage
        if name.startswith(("model.norm.", "lm_head.")):
            return body.last_stage
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        if logits is not None and self.final_logit_softcap:      # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits
