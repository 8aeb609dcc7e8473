"""K-quant blocks for the tests (the gguf package reads Q4_K, Q5_K and Q6_K but does not write them): a plain
quantizer per type that lays its super-blocks of 256 out as ggml does, and random valid blocks of every type the
kernels run. Whatever is written here is read back by the gguf package's dequantizers (and by transformers
through them), so a layout mistake shows as a mismatch there, not as agreement with the engine."""
import numpy as np

QK_K = 256


def quantize(w: np.ndarray, name: str) -> np.ndarray:
    """fp32 w [rows, k], k a multiple of 256, as rows of `name` blocks (uint8)."""
    rows = w.shape[0]
    sub = w.reshape(-1, QK_K).astype(np.float32)
    blocks = _q6_k(sub) if name == "Q6_K" else _q45_k(sub, 15 if name == "Q4_K" else 31)
    return blocks.reshape(rows, -1)


def _f16(x: np.ndarray) -> np.ndarray:
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
    parts = [_f16(d), _f16(dmin), scales_mins(sc, mn)]
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
    return np.concatenate([low.reshape(n, 128), high.reshape(n, 64), sc.view(np.uint8), _f16(d)], axis=1)


def random_blocks(rows: int, k: int, name: str, seed: int) -> np.ndarray:
    """Random valid rows of `name` blocks: random quants and scales, fp16 scales of a sane size (signs mixed)."""
    import gguf
    qtype = gguf.GGMLQuantizationType[name]
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * (k // size), nbytes), dtype=np.uint8)

    def half(lo, hi):
        return _f16(rng.uniform(lo, hi, raw.shape[0]).astype(np.float32))
    if name == "Q6_K":
        raw[:, -2:] = half(-0.004, 0.004)
    else:
        raw[:, 0:2] = half(-0.01, 0.01)
        if name in ("Q4_K", "Q5_K", "Q5_1", "Q4_1"):
            raw[:, 2:4] = half(-0.003, 0.01)
    return raw.reshape(rows, -1)
