"""RMSNorm (with the residual add fused in), rotary embedding and SiLU-and-mul.

Each runs as one C kernel call for fp32 or bf16 on CPU (layers/cpu_kernels.py) and as torch ops otherwise.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.weight_loading import copy_checked


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with residual: (norm(x + residual), x + residual), the sum written into residual."""
        if (kernels := cpu_kernels.for_tensor(x)) is not None:
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        residual.add_(x)
        return self._norm(residual), residual


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale (YaRN's attention factor; 1 otherwise) for one rope setting.

    `scaling` is the config's rope parameters without rope_theta, as ModelConfig checked them (model_config.ROPE_TYPES);
    None or rope_type "default" means plain RoPE.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    original = scaling["original_max_position_embeddings"]
    if kind == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are divided by factor, short ones kept, the band between blended by context ratio
        smooth = ((original / wavelen - low) / (high - low)).clamp(0, 1)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq, 1.0
    if kind == "yarn":
        def correction_dim(rotations):    # the dimension whose wavelength fits `rotations` times in `original`
            return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        lo, hi = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float) - lo) / ((hi - lo) or 1e-3)).clamp(0, 1)
        inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            def mscale(m):
                return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attention_factor = mscale(m) / mscale(m_all) if m and m_all else mscale(1)
        return inv_freq, float(attention_factor)
    raise ValueError(f"rope_type {kind!r} is not implemented")


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves), as in Qwen and Llama; cos/sin precomputed for every position, scaled
    as the config's rope_scaling says (rope_inv_freq)."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None,
                 rotary_dim: int = 0):
        """rotary_dim: the features of each head that rotate (0: all; fewer with a partial_rotary_factor)."""
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        inv_freq, attention_factor = rope_inv_freq(self.rotary_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotated q and k ([tokens, heads, head_dim]); the C kernel rotates them in place."""
        if (kernels := cpu_kernels.for_tensor(q)) is not None:
            return kernels.rope(q, k, positions, self.cos_sin)
        cos, sin = self.cos_sin[positions].unsqueeze(-2).chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        x1, x2 = rot.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest.float()), dim=-1).to(x.dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm, x * rsqrt(mean(x^2) + eps) * (1 + weight): the checkpoint stores weight, the parameter
    holds 1 + weight (added once at load), so the kernels are RMSNorm's."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__(size, eps)
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded) -> None:
        copy_checked(param.data, loaded[:].float() + 1.0, "norm weight")


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (kernels := cpu_kernels.for_tensor(x)) is not None:
            return kernels.silu_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu(gate) * up with gelu's tanh approximation (GeGLU, transformers' gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


# the config's hidden_act -> the gated activation (ModelConfig refuses the others by name)
GATED_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}
