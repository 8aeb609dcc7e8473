"""The quantized KV cache (EngineConfig.kv_cache_dtype): its formats, the store of a step's K/V into it, and the
torch reads every backend without its own dequantizing kernel goes through.

Formats: "auto" keeps K/V in the model's dtype. "int8", "fp8" (= "fp8_e4m3", torch.float8_e4m3fn) and "fp8_e5m2"
store each token's K (and V) vector of one KV head as 8-bit values with one fp32 scale of its own: symmetric,
scale = absmax / QMAX (127 for int8, 448 for e4m3, 57344 for e5m2), value = x / scale rounded to nearest (int8:
half to even; fp8: torch's cast). A zero vector gets scale 0 and values 0. vLLM's fp8 default is one scale per
tensor (1.0 unless calibrated); a scale per head and token costs 4 bytes a vector and keeps outliers of one token
from flattening every other.

Layout per layer: values [num_blocks, block_size, kv_heads, head_dim] in the 8-bit dtype, scales [num_blocks,
block_size, kv_heads] fp32: a block's scales move with its values (block copies, prefix hits) by the same index.
Every attention read sees dequantized values, the step's own new K/V included (`Attention` round-trips them), so a
token's output does not depend on whether its keys came from the cache or from this step: chunked prefill, prefix
hits and preemption give the tokens of one pass.
"""
import torch

from nanovllm_tp.layers import cpu_kernels

KV_CACHE_DTYPES = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn,
                   "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
ALL_KV_DTYPES = tuple(KV_CACHE_DTYPES)
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALE_DTYPE = torch.float32


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache's values are stored in: the model's for "auto", else the 8-bit format."""
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def kv_token_head_bytes(kv_cache_dtype: str, head_dim: int, model_dtype: torch.dtype) -> int:
    """Bytes of one token's K (or V) vector of one KV head, its scale included."""
    storage = kv_storage_dtype(kv_cache_dtype, model_dtype)
    scale = SCALE_DTYPE.itemsize if storage in QMAX else 0
    return head_dim * storage.itemsize + scale


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., dim] -> (values [..., dim] in dtype, fp32 scales [...]): one symmetric scale per vector."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / QMAX[dtype]
    scaled = xf / scale.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
    if dtype is torch.int8:
        return scaled.round().clamp_(-127, 127).to(torch.int8), scale
    return scaled.clamp_(-QMAX[dtype], QMAX[dtype]).to(dtype), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize, in dtype (the product is taken in fp32 and rounded once)."""
    return (values.float() * scale.unsqueeze(-1)).to(dtype)


def roundtrip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as attention reads it back from a cache of this format."""
    return dequantize(*quantize(x, dtype), x.dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An 8-bit tensor as uint8 (torch's CPU copy kernels take no fp8)."""
    return t.view(torch.uint8)


def store_quantized(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    kv_scales: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor,
                    readback: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize this step's k/v [tokens, kv_heads, dim] into their slots of the cache and its scales; returns
    k/v as the cache now holds them (dequantized) with readback, else k/v themselves."""
    kernels = cpu_kernels.for_tensor(k)
    if kernels is not None:     # one C call each (csrc/kv_store.c, the same bytes) instead of a chain of torch ops
        return tuple(kernels.kv_store(x, slot_mapping, cache, scales, readback)
                     for x, cache, scales in ((k, k_cache, kv_scales[0]), (v, v_cache, kv_scales[1])))
    out = []
    for x, cache, scales in ((k, k_cache, kv_scales[0]), (v, v_cache, kv_scales[1])):
        values, scale = quantize(x, cache.dtype)
        _bytes(cache).view(-1, *x.shape[1:]).index_copy_(0, slot_mapping, _bytes(values))
        scales.view(-1, x.shape[1]).index_copy_(0, slot_mapping, scale)
        out.append(dequantize(values, scale, x.dtype) if readback else x)
    return out[0], out[1]


def gather_slots(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """Tokens `slots` of a paged cache [blocks, block_size, kv_heads, dim] -> [len(slots), kv_heads, dim] in
    dtype (dequantized when scales are given)."""
    flat = cache.view(-1, *cache.shape[2:])
    if scales is None:
        return flat[slots]
    values = _bytes(flat)[slots].view(cache.dtype)
    return dequantize(values, scales.view(-1, cache.shape[2])[slots], dtype)


def gather_blocks(cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks of a paged cache -> [len(blocks), block_size, kv_heads, dim] in dtype (dequantized when
    scales are given). index_select over whole blocks: contiguous runs, several times faster than per slot."""
    num_blocks = cache.shape[0]
    if scales is None:
        return cache.view(num_blocks, -1).index_select(0, blocks).view(-1, *cache.shape[1:])
    values = _bytes(cache).view(num_blocks, -1).index_select(0, blocks).view(cache.dtype)
    scale = scales.view(num_blocks, -1).index_select(0, blocks)
    return dequantize(values.view(-1, cache.shape[-1]), scale.view(-1), dtype).view(-1, *cache.shape[1:])


def dense_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor],
                block_tables: torch.Tensor, dtype: torch.dtype):
    """For a kernel that reads only dense caches: the blocks `block_tables` names, dequantized into fresh caches
    in table order, and the table over them ((k, v, table)). Static shapes, one copy per table entry (a block
    two rows share is dequantized twice)."""
    rows, width = block_tables.shape
    blocks = block_tables.clamp(min=0).flatten().to(torch.long)
    k = gather_blocks(k_cache, kv_scales[0], blocks, dtype)
    v = gather_blocks(v_cache, kv_scales[1], blocks, dtype)
    table = torch.arange(rows * width, dtype=block_tables.dtype, device=block_tables.device).view(rows, width)
    return k, v, table
