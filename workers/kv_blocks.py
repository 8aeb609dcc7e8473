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


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first src, first dst, length) of each stretch where both lists go up by one together: a request's blocks
    are mostly consecutive in a pool, so each stretch is one slice copy (an index_copy_ or index_select over the
    blocks one by one moves the same bytes several times slower)."""
    out = []
    for s, d in zip(src, dst):
        if out and s == out[-1][0] + out[-1][2] and d == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def read_blocks(runner, block_ids: list[int]) -> dict[str, memoryview]:
    """Every part of the cache over `block_ids`, in that order, as bytes (little-endian, as the host): a view of
    one gathered copy each, which msgpack packs as it is."""
    stretches = runs(block_ids, list(range(len(block_ids))))
    out = {}
    for name, t in _tensors(runner).items():
        cache = _as_bytes(t)
        gathered = torch.empty((cache.shape[0], len(block_ids), *cache.shape[2:]), dtype=torch.uint8)
        for block, row, n in stretches:
            gathered[:, row:row + n].copy_(cache[:, block:block + n])
        out[name] = memoryview(gathered.numpy()).cast("B")
    return out


def write_blocks(runner, parts: dict[str, bytes], rows: list[int], block_ids: list[int]) -> None:
    """Write the blocks `rows` of a request's parts (positions in its block list, as read_blocks gave them) into
    this cache's blocks `block_ids`. The parts' sizes were checked against this cache (engine/kv_payload.py)."""
    if not rows:
        return
    stretches = runs(rows, block_ids)
    for name, t in _tensors(runner).items():
        cache = _as_bytes(t)
        with warnings.catch_warnings():      # the payload's bytes are read-only; they are only read from here
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(np.frombuffer(parts[name], np.uint8))
        data = data.view(cache.shape[0], -1, *cache.shape[2:])
        for row, block, n in stretches:
            cache[:, block:block + n].copy_(data[:, row:row + n])
