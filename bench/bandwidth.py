"""Memory read bandwidth, measured by the benchmark itself, and the share of it a one-stream decode uses.

A decode step of one request reads every weight the token passes through (and the request's KV) from memory
once the model is many times the last-level cache: its tok/s is bounded by bandwidth / bytes per token. Every
benchmark's environment record carries `read_bandwidth` (bench/env.py): the machine's read rate, csrc/read_rate.c
streaming a buffer of CACHE_MULTIPLE times the last-level cache (from sysfs; at least MIN_BYTES) with the run's
thread count, each thread's share read as 1, 4 or 8 streams side by side, with and without a software prefetch
AHEAD bytes in front (CONFIGS), best of READS reads of each after one untimed read (pages touched, threads
started); the best of all. `read_sampler` reads it again beside another measurement, for shares of the same
moment. Where the C kernels cannot be built, a torch sum over the same buffer stands in (`how`
says which). The torch sum is not the limit: on an AMD EPYC with two threads it read 30-32 GB/s while the read
rate was 33-35 and the engine's quantized decode moved up to 37 (`nanovllm-tp bench kernels --one-row` puts each
kernel's one-row rate beside the read rate: no kernel may beat it). `bench throughput` with one request puts
beside its figure the bytes read per token (`model_read_bytes`: weights as the engine holds them, plus the mean
KV the request's decode steps read) times tok/s, as a share of that bandwidth (`decode_share`).
"""
from __future__ import annotations

import functools
import glob
import os
import time

CACHE_MULTIPLE = 16
MIN_BYTES = 256 << 20
MAX_BYTES = 4 << 30
READS = 3
AHEAD = (2048, 4096)
# (streams a thread, prefetch distance)
CONFIGS = ((1, 0), (4, 0), (8, 0), *((streams, ahead) for ahead in AHEAD for streams in (1, 4, 8)))


def last_level_cache_bytes() -> int | None:
    """The largest cache level's size of CPU 0 (sysfs), or None where the kernel does not say."""
    best = None
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(index, "size")) as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        if best is None or level > best[0] or (level == best[0] and size > best[1]):
            best = (level, size)
    return best[1] if best else None


def buffer_bytes(llc: int | None) -> int:
    return min(MAX_BYTES, max(MIN_BYTES, CACHE_MULTIPLE * (llc or 0)))


def _best_seconds(read, reads: int) -> float:
    read()
    best = float("inf")
    for _ in range(reads):
        t0 = time.perf_counter()
        read()
        best = min(best, time.perf_counter() - t0)
    return best


@functools.lru_cache(maxsize=8)
def read_bandwidth(threads: int) -> dict:
    """Read bandwidth with `threads` threads: {"gb_s", "buffer_bytes", "llc_bytes", "threads", "reads", "how",
    "streams", "ahead"}; measured once per thread count in a process."""
    import torch

    from nanovllm_tp.layers import cpu_kernels
    llc = last_level_cache_bytes()
    nbytes = buffer_bytes(llc)
    kernels = cpu_kernels.load()
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    try:
        if kernels is not None:
            timed = {(streams, ahead): _best_seconds(
                lambda: kernels.read_stream(buffer, threads, streams, ahead), READS) for streams, ahead in CONFIGS}
            (streams, ahead), best = min(timed.items(), key=lambda item: item[1])
            how = (f"csrc/read_rate.c over max({MIN_BYTES >> 20} MiB, {CACHE_MULTIPLE} x the last-level cache), "
                   f"{'/'.join(str(c) for c in sorted({c[0] for c in CONFIGS}))} streams a thread, prefetch 0 or "
                   f"{' or '.join(map(str, AHEAD))} B, best of {READS} each")
        else:
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                best = _best_seconds(buffer.sum, READS)
            finally:
                torch.set_num_threads(before)
            streams, ahead = None, None
            how = (f"torch.sum over a float32 buffer of max({MIN_BYTES >> 20} MiB, {CACHE_MULTIPLE} x the "
                   f"last-level cache), best of {READS} (no C kernels here)")
    finally:
        del buffer
    return {"gb_s": nbytes / best / 1e9, "buffer_bytes": nbytes, "llc_bytes": llc, "threads": threads,
            "reads": READS, "how": how, "streams": streams, "ahead": ahead}


def read_sampler(threads: int):
    """A function that reads the read rate's buffer once, as read_bandwidth's best configuration does, and returns
    GB/s; None where the C kernels cannot be built. For figures paired with the read rate of the same moment: on a
    shared VM the rate moves by tens of percent within seconds (an AMD EPYC here: 30 to 58 GB/s), so a share is
    the median of (rate measured) / (read rate sampled right after), not a ratio of figures from other moments."""
    import torch

    from nanovllm_tp.layers import cpu_kernels
    kernels = cpu_kernels.load()
    best = read_bandwidth(threads)
    if kernels is None or best["streams"] is None:
        return None
    buffer = torch.ones(best["buffer_bytes"] // 4, dtype=torch.float32)

    def sample() -> float:
        t0 = time.perf_counter()
        kernels.read_stream(buffer, threads, best["streams"], best["ahead"])
        return best["buffer_bytes"] / (time.perf_counter() - t0) / 1e9
    return sample


# =============================================================================================== bytes per token

def weight_read_bytes(model: str, dtype, quantization: str = "none") -> dict:
    """Bytes of weights one decoded token reads: every tensor of the checkpoint as the engine holds it: in the
    engine's dtype, or, where the engine runs quantized weights (`quantization`: LLM.stats()'s, "Q4_0+Q8_0"), a
    GGUF file's blocks of those types, or a quantized directory's projections in its one type; the embedding
    counted only where it is also the LM head (tied); a MoE layer's experts as the share a token routes to."""
    import math

    from nanovllm_tp.checkpoint.gguf_header import require_gguf
    from nanovllm_tp.checkpoint.loader import checkpoint_tensors
    from nanovllm_tp.config.model_config import ModelConfig
    config = ModelConfig.from_pretrained(model)
    kinds = set() if quantization in (None, "none") else set(quantization.split("+"))
    sizes = require_gguf().GGML_QUANT_SIZES if kinds else {}
    total, embedding = 0, 0
    for name, tensor, _ in checkpoint_tensors(model, keep_blocks=False):
        shape = tuple(tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape)
        numel = math.prod(shape)
        entry = getattr(tensor, "entry", None)          # a GGUF tensor: its type as stored
        kind = None
        if len(shape) == 2 and entry is not None:
            import gguf
            stored = gguf.GGMLQuantizationType(entry.ggml_type).name
            kind = stored if stored in kinds else None
        elif len(shape) == 2 and len(kinds) == 1 and "embed_tokens" not in name and "lm_head" not in name:
            kind = next(iter(kinds))
        if kind is not None:
            import gguf
            block, block_bytes = sizes[gguf.GGMLQuantizationType[kind]]
            nbytes = numel // block * block_bytes
        else:
            nbytes = numel * dtype.itemsize
        if "embed_tokens" in name:
            embedding = nbytes
            continue
        if ".experts." in name and config.num_experts:
            nbytes = nbytes * config.num_experts_per_tok // config.num_experts
        total += nbytes
    if config.tie_word_embeddings:
        total += embedding
    return {"weights": total, "embedding_as_lm_head": bool(config.tie_word_embeddings)}


def kv_read_bytes(model: str, dtype, kv_cache_dtype: str, context_tokens: float) -> int:
    """Bytes of K and V one decode step reads at a context of `context_tokens`, every layer."""
    from nanovllm_tp.config.model_config import ModelConfig
    from nanovllm_tp.layers.attention.kv_quant import kv_token_head_bytes
    c = ModelConfig.from_pretrained(model)
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * kv_token_head_bytes(kv_cache_dtype, c.head_dim,
                                                                                      dtype)
    return int(per_token * context_tokens)


def decode_share(tok_s: float, weight_bytes: int, kv_bytes: int, bandwidth_gb_s: float) -> dict:
    """bytes read per token x tok/s, and its share of the measured read bandwidth."""
    per_token = weight_bytes + kv_bytes
    gb_s = per_token * tok_s / 1e9
    return {"bytes_per_token": per_token, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "gb_s": gb_s,
            "bandwidth_gb_s": bandwidth_gb_s, "share": gb_s / bandwidth_gb_s}


def one_stream_share(llm, model: str, workload, tok_s: float, threads: int) -> dict:
    """decode_share of a one-request run of `workload` on the engine `llm`: its weights as held, the KV at the
    mean context of its decode steps (prompt + half the output), bandwidth at `threads`."""
    engine = llm.engine
    quantization = llm.stats().get("quantization") or "none"
    weights = weight_read_bytes(model, engine.dtype, quantization)
    context = workload.prompt_tokens + (workload.requested_output_tokens - 1) / 2
    kv = kv_read_bytes(model, engine.dtype, engine.config.kv_cache_dtype, context)
    bandwidth = read_bandwidth(threads)
    return {**decode_share(tok_s, weights["weights"], kv, bandwidth["gb_s"]), "threads": threads,
            "quantization": quantization, "mean_context": context}
