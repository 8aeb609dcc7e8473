"""Counter-based sampling noise: uniforms in (0, 1) that are a hash (splitmix64) of (request seed, token index,
vocab id), so a request's draws depend only on its own seed and logits: not on the batch it shares, not on the
device. The torch form computes with int64 tensor ops, the numpy form is the same bits for small candidate sets;
csrc/sampler.c hashes alike."""
import numpy as np
import torch

_MASK64 = (1 << 64) - 1


def _as_int64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _as_int64(0x9E3779B97F4A7C15), _as_int64(0xBF58476D1CE4E5B9), _as_int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift on int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, index: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) for the vocab ids of each row (ids [vocab] shared, or [rows, k] per row), a pure
    function of (seed, index, vocab id)."""
    row_key = _splitmix64(_splitmix64(seeds) ^ index)
    mixed = _splitmix64(ids)
    mixed = mixed[None, :] if mixed.dim() == 1 else mixed
    bits = _shr(_splitmix64(row_key[:, None] ^ mixed), 11)   # 53 random bits
    return (bits.to(torch.float64) + 0.5) * (1.0 / (1 << 53))


_U64 = np.uint64


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def uniform_noise_np(seeds: np.ndarray, index: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """uniform_noise in numpy, bit for bit (uint64 arithmetic wraps like int64), for small candidate sets
    where torch's per-op cost dominates."""
    with np.errstate(over="ignore"):
        row_key = _splitmix64_np(_splitmix64_np(seeds.astype(_U64)) ^ index.astype(_U64))
        bits = _splitmix64_np(row_key[:, None] ^ _splitmix64_np(ids.astype(_U64))) >> _U64(11)
    return (bits.astype(np.float64) + 0.5) * (1.0 / (1 << 53))
