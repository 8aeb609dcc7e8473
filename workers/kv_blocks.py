"""A rank's KV blocks as bytes and back: what a request's KV is when it moves to another engine
(engine/kv_transfer.py).

The cache is [layers, blocks, block_size, kv_heads, head_dim] for K and for V (workers/kv_cache.py), and for an 8-bit
cache an fp32 scale per token and KV head beside each ([layers, blocks, block_size, kv_heads]). A request's part is
the same arrays over its blocks only, in its block-table order, as raw bytes of the cache's own dtype (bf16, int8
and fp8 moved bit for bit, as bytes: torch indexes them as uint8).

Under tensor parallelism each rank holds its own KV heads, and rank 0 speaks for the engine: it publishes a KV_READ
or KV_WRITE plan (scheduler/plan.py) naming the blocks, and every rank of the TP group takes part in one collective
per cache array (`gather_blocks`: each rank's part to rank 0; `scatter_blocks`: rank 0 hands each rank its part).
A request's part is then [TP ranks, layers, blocks, ...], rank i's heads i-th: TP rank i of one engine sends to TP
rank i of the other, and both must have the same TP size (the payload's layout says so: engine/kv_payload.py).
"""
import os
import threading
import warnings
from collections import OrderedDict

import numpy as np
import torch

from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.workers.kv_pool import SharedKVPool

_MAX_PEERS = 4      # other engines' pools kept mapped (a mapping keeps a stopped engine's pool in memory)

def _tensors(runner) -> dict[str, torch.Tensor]:
    """The runner's cache arrays by part name (the scales only for a quantized cache)."""
    out = {"k": runner.k_cache, "v": runner.v_cache}
    if runner.kv_scales is not None:
        out["k_scale"], out["v_scale"] = runner.kv_scales
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of t, its last dim counted in bytes (fp8 cannot be indexed on CPU, bf16 has no numpy)."""
    return t.view(torch.uint8)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src, two [layers, blocks, ...] byte views of caches: on CPU one memcpy per piece of a layer's
    blocks spread over the threads (csrc/kv_store.c's copy_runs, where the kernels run), else torch's copy."""
    kernels = cpu_kernels.active() if dst.is_cpu and src.is_cpu else None
    if kernels is None:
        dst.copy_(src)
    else:
        kernels.copy_runs(dst, src)


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
    return {name: memoryview(part.numpy()).cast("B") for name, part in _read(runner, block_ids, "cpu").items()}


def _read(runner, block_ids: list[int], device) -> dict[str, torch.Tensor]:
    """Each cache array over `block_ids`, in that order, as uint8 [layers, blocks, ...] on `device`."""
    stretches = runs(block_ids, list(range(len(block_ids))))
    out = {}
    for name, t in _tensors(runner).items():
        cache = _as_bytes(t)
        gathered = torch.empty((cache.shape[0], len(block_ids), *cache.shape[2:]), dtype=torch.uint8, device=device)
        for block, row, n in stretches:
            _copy(gathered[:, row:row + n], cache[:, block:block + n])
        out[name] = gathered
    return out


def _write(runner, parts: dict[str, torch.Tensor], rows: list[int], block_ids: list[int]) -> None:
    """Each cache array's blocks `block_ids` from the blocks `rows` of parts[name], uint8 [layers, blocks, ...]."""
    stretches = runs(rows, block_ids)
    for name, t in _tensors(runner).items():
        cache = _as_bytes(t)
        for row, block, n in stretches:
            _copy(cache[:, block:block + n], parts[name][:, row:row + n])


def gather_blocks(runner, block_ids: list[int]) -> dict[str, memoryview] | None:
    """Every rank of the TP group (rank 0 once it has published a KV_READ plan of `block_ids`, the others as they
    run it): each rank's part of every cache array over `block_ids` to rank 0, which returns each array's bytes as
    [TP ranks, layers, blocks, ...]; None on the other ranks."""
    import torch.distributed as dist
    from nanovllm_tp.distributed.parallel_state import current_tp
    tp = current_tp()
    mine, out = _read(runner, block_ids, runner.k_cache.device), {}
    for name, part in mine.items():
        whole = torch.empty((tp.size, *part.shape), dtype=torch.uint8, device=part.device) if tp.rank == 0 else None
        dist.gather(part, None if whole is None else list(whole.unbind(0)), dst=dist.get_global_rank(tp.group, 0),
                    group=tp.group)
        if whole is not None:
            out[name] = memoryview(whole.cpu().numpy()).cast("B")
    return out if tp.rank == 0 else None


def scatter_blocks(runner, parts: dict[str, bytes] | None, rows: list[int], block_ids: list[int]) -> None:
    """Every rank of the TP group (rank 0 once it has published a KV_WRITE plan of `block_ids`, the others as they
    run it): rank 0's `parts` ([TP ranks, layers, blocks, ...] bytes, as gather_blocks gave them, checked against
    this cache), their blocks `rows`, go each rank's part to its rank, which writes it into `block_ids`."""
    import torch.distributed as dist
    from nanovllm_tp.distributed.parallel_state import current_tp
    tp = current_tp()
    device, mine = runner.k_cache.device, {}
    index = torch.tensor(rows, dtype=torch.long) if tp.rank == 0 else None
    for name, t in _tensors(runner).items():
        cache = _as_bytes(t)
        mine[name] = torch.empty((cache.shape[0], len(block_ids), *cache.shape[2:]), dtype=torch.uint8,
                                 device=device)
        chunks = None
        if tp.rank == 0:
            whole = _bytes_tensor(parts[name]).view(tp.size, cache.shape[0], -1, *cache.shape[2:])
            chunks = [whole[r].index_select(1, index).to(device) for r in range(tp.size)]
        dist.scatter(mine[name], chunks, src=dist.get_global_rank(tp.group, 0), group=tp.group)
    _write(runner, mine, list(range(len(block_ids))), block_ids)


def _bytes_tensor(data) -> torch.Tensor:
    """A read-only uint8 tensor over bytes (a payload's), no copy; only ever read from."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.frombuffer(data, np.uint8))


def write_blocks(runner, parts: dict[str, bytes], rows: list[int], block_ids: list[int]) -> None:
    """Write the blocks `rows` of a request's parts (positions in its block list, as read_blocks gave them) into
    this cache's blocks `block_ids`. The parts' sizes were checked against this cache (engine/kv_payload.py)."""
    if not rows:
        return
    shapes = {name: _as_bytes(t).shape for name, t in _tensors(runner).items()}
    _write(runner, {name: _bytes_tensor(parts[name]).view(shape[0], -1, *shape[2:]) for name, shape in shapes.items()},
           rows, block_ids)


def copy_from_peer(runner, pool: dict, blocks: list[int], versions: list[int], rows: list[int],
                   block_ids: list[int]) -> bool:
    """Copy the blocks `rows` of a request whose KV sits in another engine's shared pool (`pool`: its pid, fd and
    token; `blocks`: the request's block ids there, `versions` theirs when it left) into this cache's blocks
    `block_ids`, pool to pool. False when they cannot be used: that pool is gone or unlike this one, a block id is
    outside it, or a block was taken for other tokens there before the copy ended (its version moved)."""
    peer = _peer(pool)
    if peer is None:
        return False
    mine = _tensors(runner)
    if peer.header["kv_dtype"] != runner.kv_cache_format() or sorted(peer.parts) != sorted(mine) or any(
            peer.parts[name].shape[:1] + peer.parts[name].shape[2:] != t.shape[:1] + t.shape[2:]
            for name, t in mine.items()):
        return False
    if any(blocks[r] >= peer.num_blocks for r in rows):
        return False
    src = [blocks[r] for r in rows]
    for name, t in mine.items():
        theirs, cache = _as_bytes(peer.parts[name]), _as_bytes(t)
        for first, block, n in runs(src, block_ids):
            _copy(cache[:, block:block + n], theirs[:, first:first + n])
    stamps = peer.stamps
    return all(stamps[blocks[r]] == versions[r] for r in rows)


def _peer(ref: dict) -> SharedKVPool | None:
    """Another engine's pool, mapped once and kept (at most _MAX_PEERS, those of stopped engines dropped); None when
    it cannot be opened."""
    for token in [t for t, p in _PEERS.items() if not os.path.exists(f"/proc/{p.pid}")]:
        _PEERS.pop(token).close()
    peer = _PEERS.get(ref["token"])
    if peer is None:
        try:
            peer = SharedKVPool.open_peer(ref)
        except ValueError:
            return None
        threading.Thread(target=peer.populate, name="nvtp-kv-peer-populate", daemon=True).start()
        _PEERS[ref["token"]] = peer
        while len(_PEERS) > _MAX_PEERS:
            _PEERS.popitem(last=False)[1].close()
    _PEERS.move_to_end(ref["token"])
    return peer


_PEERS: OrderedDict[str, SharedKVPool] = OrderedDict()
