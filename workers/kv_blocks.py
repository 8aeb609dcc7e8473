"""A rank's KV blocks as bytes and back: what a request's KV is when it moves to another engine
(engine/kv_transfer.py).

The cache is [layers, blocks, block_size, kv_heads, head_dim] for K and for V (workers/kv_cache.py), and for an 8-bit
cache an fp32 scale per token and KV head beside each ([layers, blocks, block_size, kv_heads]). A request's part is
the same arrays over its blocks only, in its block-table order, as raw bytes of the cache's own dtype (bf16, int8
and fp8 moved bit for bit, as bytes: torch indexes them as uint8).
"""
import warnings

import numpy as np
import torch

def _tensors(runner) -> dict[str, torch.Tensor]:
    """The runner's cache arrays by part name (the scales only for a quantized cache)."""
    out = {"k": runner.k_cache, "v": runner.v_cache}
    if runner.kv_scales is not None:
        out["k_scale"], out["v_scale"] = runner.kv_scales
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of t, its last dim counted in bytes (fp8 cannot be indexed on CPU, bf16 has no numpy)."""
    return t.view(torch.uint8)


def read_blocks(runner, block_ids: list[int]) -> dict[str, memoryview]:
    """Every part of the cache over `block_ids`, in that order, as bytes (little-endian, as the host): a view of
    one gathered copy each, which msgpack packs as it is."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=runner.k_cache.device)
    return {name: memoryview(_as_bytes(t).index_select(1, index).cpu().numpy()).cast("B")
            for name, t in _tensors(runner).items()}


def write_blocks(runner, parts: dict[str, bytes], rows: list[int], block_ids: list[int]) -> None:
    """Write the blocks `rows` of a request's parts (positions in its block list, as read_blocks gave them) into
    this cache's blocks `block_ids`. The parts' sizes were checked against this cache (engine/kv_payload.py)."""
    if not rows:
        return
    device = runner.k_cache.device
    dst = torch.tensor(block_ids, dtype=torch.int64, device=device)
    for name, t in _tensors(runner).items():
        cache = _as_bytes(t)
        with warnings.catch_warnings():      # the payload's bytes are read-only; they are only read from here
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(np.frombuffer(parts[name], np.uint8))
        data = data.view(cache.shape[0], -1, *cache.shape[2:])
        if rows != list(range(data.shape[1])):      # blocks the prefix cache held are not written
            data = data.index_select(1, torch.tensor(rows, dtype=torch.int64))
        cache.index_copy_(1, dst, data.to(device))
