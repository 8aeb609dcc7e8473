"""Paged decode attention in Triton: the CUDA decode path when flash-attn is not in use.

One program per (row, kv head, split) walks its share of the row's context in tiles of TILE tokens with an
online softmax; each token's block comes from the block table, so the tile does not depend on the page size
(block 128 or 256 costs no more registers than block 16). With more than one split (flash-decoding), each
split leaves an unnormalised partial result and its softmax statistics, and a second kernel merges them.
Grid and split count depend only on tensor shapes, never on the lengths, so the call is CUDA-graph safe; the
split count is a runtime argument, so eager steps of varying shapes share two compiled variants.
A sliding window (runtime `window` > 0) starts the walk at the tile of the row's first visible token, and the
splits share only the window's tiles; a logit cap (`softcap` > 0) is a compiled variant of its own.
"""
import functools

import torch
import triton
import triton.language as tl

MAX_SPLITS = 16
MIN_TILES_PER_SPLIT = 4      # a split shorter than this costs more to merge than it saves


@triton.jit
def _paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
                         part_ptr, stats_ptr, scale, num_splits, window, softcap,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                         SPLIT: tl.constexpr, SOFTCAP: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + row)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)     # tl.arange needs a power of two; head_dim 80 or 96 is masked
    s = tl.arange(0, TILE)
    heads = kv_head * GROUP + g
    dim_mask = d < HEAD_DIM
    q_mask = (g < GROUP)[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask,
                other=0.0).to(tl.float32) * scale
    first_pos = tl.where(window > 0, tl.maximum(context_len - window, 0), 0)     # the first visible token
    first_tile = first_pos // TILE
    tiles = tl.cdiv(context_len, TILE)
    per_split = tl.cdiv(tiles - first_tile, num_splits)
    first = first_tile + split * per_split
    last = tl.minimum(first + per_split, tiles)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile in range(first, last):
        pos = tile * TILE + s
        in_context = (pos < context_len) & (pos >= first_pos)
        block = tl.load(block_tables_ptr + row * stride_bt + pos // BLOCK_SIZE, mask=in_context, other=0)
        offsets = (block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_ks)[:, None] \
            + kv_head * stride_kh + d[None, :]
        kv_mask = in_context[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        if SOFTCAP:
            scores = soft_cap(scores, softcap)
        scores = tl.where(in_context[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    if not SPLIT:
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]     # rows with no context (graph padding) give zeros
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:   # partial [rows, heads, splits, HEAD_DIM_PAD] and (max, sum) [rows, heads, splits, 2], fp32
        slot = (row * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(part_ptr + slot[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=q_mask)
        tl.store(stats_ptr + slot * 2, m, mask=g < GROUP)
        tl.store(stats_ptr + slot * 2 + 1, l, mask=g < GROUP)


@triton.jit
def soft_cap(scores, cap):
    """cap * tanh(scores / cap), tanh through exp (1 - 2 / (e^2x + 1): exact at both ends, where e^2x is 0 or
    inf), which every Triton build and its interpreter have."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / cap) + 1.0))


@triton.jit
def _merge_splits_kernel(part_ptr, stats_ptr, out_ptr, num_splits, stride_ot, stride_oh, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    slot = (row * tl.num_programs(1) + head) * num_splits + sp
    live = sp < num_splits
    m = tl.load(stats_ptr + slot * 2, mask=live, other=float("-inf"))
    l = tl.load(stats_ptr + slot * 2 + 1, mask=live, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)      # a row with no context: every split is empty
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    total = tl.sum(l * w, axis=0)
    part = tl.load(part_ptr + slot[:, None] * HEAD_DIM_PAD + d[None, :], mask=live[:, None], other=0.0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_tile(group_pad: int, head_dim_pad: int) -> int:
    """Tokens per tile: the fp32 [group, tile, head_dim] product stays near 8K elements (no register spills)."""
    return max(8, min(64, triton.next_power_of_2(8192 // (group_pad * head_dim_pad) + 1) // 2))


def decode_splits(rows: int, kv_heads: int, max_tiles: int, sm_count: int) -> int:
    """Splits per row so that rows * kv_heads * splits programs fill the GPU about twice, each split at least
    MIN_TILES_PER_SPLIT tiles of the longest context the block table can hold. Shapes only: graph safe."""
    want = -(-2 * sm_count // max(1, rows * kv_heads))
    return max(1, min(want, max_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [rows, heads, dim]; caches [blocks, block_size, kv_heads, dim]; returns [rows, heads, dim].
    num_splits: None picks from the shapes and the GPU's SM count; at most MAX_SPLITS. window, softcap: the
    layer's sliding window and logit cap (0: none)."""
    rows, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    group_pad, dim_pad = triton.next_power_of_2(group), triton.next_power_of_2(dim)
    tile = decode_tile(group_pad, dim_pad)
    if num_splits is None:
        max_tokens = block_tables.shape[1] * block_size
        max_tiles = -(-(min(max_tokens, window + tile) if window else max_tokens) // tile)
        sm_count = _sm_count(q.device.index or 0) if q.device.type == "cuda" else 1     # 1: the CPU interpreter
        num_splits = decode_splits(rows, kv_heads, max_tiles, sm_count)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    out = torch.empty_like(q)
    part = stats = out      # unused with one split
    if num_splits > 1:
        part = torch.empty(rows, heads, num_splits, dim_pad, dtype=torch.float32, device=q.device)
        stats = torch.empty(rows, heads, num_splits, 2, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(rows, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part, stats, scale, num_splits, window, softcap,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=dim, HEAD_DIM_PAD=dim_pad, BLOCK_SIZE=block_size, TILE=tile,
        SPLIT=num_splits > 1, SOFTCAP=softcap > 0)
    if num_splits > 1:
        _merge_splits_kernel[(rows, heads)](part, stats, out, num_splits, out.stride(0), out.stride(1),
                                            HEAD_DIM=dim, HEAD_DIM_PAD=dim_pad, SPLITS_PAD=MAX_SPLITS)
    return out
