"""GGUF's K-quants written from fp32 rows: Q4_K, Q5_K and Q6_K super-blocks of 256 weights laid out byte for byte
as ggml reads them, and the choice of type per tensor that makes a Q4_K_M file.

The gguf package reads these types but has no quantizer for them. The one here is plain: each sub-block's scale
(and, for Q4_K / Q5_K, its minimum) comes from the sub-block's range, the super-block's fp16 scales from the
largest of those, and every weight is rounded to the nearest step. llama.cpp's own quantizer searches for better
scales, so its files are a little closer to the source weights; the bytes, and so the cost per token of reading
and computing them, are the same.

Layouts (ggml's block_q4_K, block_q5_K, block_q6_K):
- Q4_K (144 bytes): d, dmin (fp16); 12 bytes of eight 6-bit scales and eight 6-bit mins; 128 bytes of nibbles,
  where byte j of chunk c (32 bytes) holds weight 64c + j low and 64c + 32 + j high. w = d * sc * q - dmin * m.
- Q5_K (176 bytes): as Q4_K with 32 bytes of high bits (bit s of byte j: sub-block s, weight j) before the
  nibbles.
- Q6_K (210 bytes): 128 bytes of low nibbles, 64 of 2-bit high pairs, sixteen int8 scales, d (fp16);
  w = d * sc * (q - 32) over sub-blocks of 16.
"""
from __future__ import annotations

import numpy as np

QK_K = 256
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def quantize(w: np.ndarray, name: str) -> np.ndarray:
    """fp32 w [rows, k], k a multiple of 256, as rows of `name` blocks (uint8 [rows, k / 256 * block bytes])."""
    if name not in K_TYPES:
        raise ValueError(f"K-quant type must be one of {', '.join(K_TYPES)}, got {name!r}")
    rows, k = w.shape
    if k % QK_K:
        raise ValueError(f"{name} needs rows of a multiple of {QK_K} weights, got {k}")
    sub = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, QK_K)
    blocks = _q6_k(sub) if name == "Q6_K" else _q45_k(sub, 15 if name == "Q4_K" else 31)
    return blocks.reshape(rows, -1)


def use_more_bits(layer: int, layers: int) -> bool:
    """The layers whose attention V and MLP down projections a Q4_K_M file holds in Q6_K: the first and last
    eighth, and every third layer between them (llama.cpp's rule)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, k: int, layers: int, tied: bool) -> str:
    """The type of a 2-D tensor (HF name, k weights a row) in a Q4_K_M file of `layers` decoder layers: Q6_K for
    the LM head (and for the embedding it shares), V and down projections where use_more_bits says so, Q4_K for
    the rest; where k is not a multiple of 256, the 32-weight type llama.cpp falls back to (Q8_0, Q5_0)."""
    if "lm_head" in name or ("embed_tokens" in name and tied):
        kind = "Q6_K"
    elif name.endswith(("v_proj.weight", "down_proj.weight")):
        layer = int(name.split("layers.", 1)[1].split(".", 1)[0])
        kind = "Q6_K" if use_more_bits(layer, layers) else "Q4_K"
    else:
        kind = "Q4_K"
    if k % QK_K:
        kind = {"Q6_K": "Q8_0", "Q4_K": "Q5_0"}[kind]
    return kind


def f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(x.shape[0], 2)


def _safe_div(a, b):
    return np.divide(a, b, out=np.zeros_like(a, dtype=np.float32), where=b != 0)


def _q45_k(sub: np.ndarray, qmax: int) -> np.ndarray:
    n = sub.shape[0]
    x = sub.reshape(n, 8, 32)
    low = np.minimum(x.min(-1), 0)
    scale, offset = (x.max(-1) - low) / qmax, -low                       # [n, 8] each
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (offset.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(_safe_div(offset, dmin[:, None])), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.round(_safe_div(x + (dmin[:, None] * mn)[..., None], step)), 0, qmax).astype(np.uint8)
    nibbles = (q[:, 0::2] & 0xF) | (q[:, 1::2] & 0xF) << 4             # chunk c: sub-blocks 2c (low), 2c + 1 (high)
    parts = [f16_bytes(d), f16_bytes(dmin), scales_mins(sc, mn)]
    if qmax == 31:
        parts.append(np.bitwise_or.reduce(((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    return np.concatenate(parts + [nibbles.reshape(n, 128)], axis=1)


def scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 6-bit scales and mins, [n, 8] uint8 each, as ggml packs them in 12 bytes."""
    packed = np.zeros((sc.shape[0], 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    packed[:, 4:8] = mn[:, :4] | (mn[:, 4:] >> 4) << 6
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | (mn[:, 4:] & 0xF) << 4
    return packed


def _q6_k(sub: np.ndarray) -> np.ndarray:
    n = sub.shape[0]
    x = sub.reshape(n, 16, 16)
    scale = np.abs(x).max(-1) / 31                                      # [n, 16]
    d = (np.abs(scale).max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d[:, None])), -128, 127).astype(np.int8)
    step = (d[:, None] * sc)[..., None]
    q = (np.clip(np.round(_safe_div(x, step)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    low = (q[:, :, :2] & 0xF) | (q[:, :, 2:] & 0xF) << 4                # chunk of 128: values j and 64 + j
    high = np.bitwise_or.reduce(((q >> 4) & 3) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2)
    return np.concatenate([low.reshape(n, 128), high.reshape(n, 64), sc.view(np.uint8), f16_bytes(d)], axis=1)
