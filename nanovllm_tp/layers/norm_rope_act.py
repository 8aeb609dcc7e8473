"""RMSNorm (with the residual add fused in), rotary embedding and SiLU-and-mul.

Each runs as one C kernel call for fp32 on CPU (layers/cpu_kernels.py) and as torch ops otherwise.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm_tp.layers import cpu_kernels


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


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves), as in Qwen and Llama; cos/sin precomputed for every position."""

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        self.register_buffer("cos_sin", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotated q and k ([tokens, heads, head_dim]); the C kernel rotates them in place."""
        if (kernels := cpu_kernels.for_tensor(q)) is not None:
            return kernels.rope(q, k, positions, self.cos_sin)
        cos, sin = self.cos_sin[positions].unsqueeze(-2).chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (kernels := cpu_kernels.for_tensor(x)) is not None:
            return kernels.silu_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
