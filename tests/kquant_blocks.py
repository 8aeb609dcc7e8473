"""Random valid K-quant blocks (and of the 32-weight types beside them) for the kernels' tests. The quantizer that
writes K-quants from weights is launch/k_quants.py; whatever it writes is read back by the gguf package's
dequantizers (and by transformers through them), so a layout mistake shows as a mismatch there, not as agreement
with the engine."""
import numpy as np

from nanovllm_tp.launch.k_quants import f16_bytes


def random_blocks(rows: int, k: int, name: str, seed: int) -> np.ndarray:
    """Random valid rows of `name` blocks: random quants and scales, fp16 scales of a sane size (signs mixed)."""
    import gguf
    qtype = gguf.GGMLQuantizationType[name]
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * (k // size), nbytes), dtype=np.uint8)

    def half(lo, hi):
        return f16_bytes(rng.uniform(lo, hi, raw.shape[0]).astype(np.float32))
    if name == "Q6_K":
        raw[:, -2:] = half(-0.004, 0.004)
    else:
        raw[:, 0:2] = half(-0.01, 0.01)
        if name in ("Q4_K", "Q5_K", "Q5_1", "Q4_1"):
            raw[:, 2:4] = half(-0.003, 0.01)
    return raw.reshape(rows, -1)
