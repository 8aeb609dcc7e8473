"""Paged prefill attention in Triton: new tokens of each row attend to the row's whole context (cached prefix
and this step's tokens, already written to the paged cache) with a lower-right causal mask.

One program per (row, query tile, kv head) holds BLOCK_M queries x GROUP query heads as the rows of one tile
and walks the row's keys in BLOCK_N-token tiles with an online softmax, looking up each key's block in the
block table. Memory is the output only: no score matrix, no gathered K/V, whatever the prefix length. The
torch-cuda backend uses it for every prefill over a cached prefix (later chunks of a chunked prompt, prefix
cache hits, mixed steps), and for fp32 prefill. A sliding window (runtime `window` > 0) starts each query tile's
walk at the key tile of its first query's first visible key; a logit cap is a compiled variant.
"""
import torch
import triton
import triton.language as tl

from nanovllm_tp.layers.triton_decode import soft_cap

# 64 tile rows x 32 keys with 8 warps: ptxas (sm_90a, head_dim 128, group 1..8) reports ~220 registers and no
# spills for bf16 and fp32; with 4 warps bf16 spills a little and fp32 (FMA dot) spills ~20 KB per thread.
BLOCK_N, NUM_WARPS = 32, 8


@triton.jit
def _paged_prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
                          out_ptr, scale, window, softcap, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                          stride_bt, stride_ot, stride_oh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                          HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                          SOFTCAP: tl.constexpr):
    row = tl.program_id(0)
    m_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + row)
    q_len = tl.load(cu_seqlens_q_ptr + row + 1) - q_start
    kv_len = tl.load(context_lens_ptr + row)
    prefix = kv_len - q_len                       # query j sits at position prefix + j
    i = tl.arange(0, BLOCK_M * GROUP_PAD)          # tile rows: (query, head of the group) pairs
    qi = m_tile * BLOCK_M + i // GROUP_PAD
    g = i % GROUP_PAD
    d = tl.arange(0, HEAD_DIM_PAD)
    row_ok = (qi < q_len) & (g < GROUP)
    dim_ok = d < HEAD_DIM
    q_offsets = (q_start + qi).to(tl.int64)[:, None] * stride_qt + (kv_head * GROUP + g)[:, None] * stride_qh \
        + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = prefix + qi
    # keys up to the last query of this tile; a tile past the row's queries has nothing to do
    kv_end = tl.where(m_tile * BLOCK_M < q_len, tl.minimum(kv_len, prefix + (m_tile + 1) * BLOCK_M), 0)
    m = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    # a window hides the keys before the tile's first query's window: start at their key tile, and load none of
    # them (their blocks may be stale)
    kv_first = tl.where(window > 0, tl.maximum(prefix + m_tile * BLOCK_M - window + 1, 0), 0)
    for start in range(kv_first // BLOCK_N * BLOCK_N, kv_end, BLOCK_N):
        pos = start + n
        in_context = (pos < kv_end) & (pos >= kv_first)
        block = tl.load(block_tables_ptr + row * stride_bt + pos // BLOCK_SIZE, mask=in_context, other=0)
        kv_offsets = (block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_ks)[:, None] \
            + kv_head * stride_kh + d[None, :]
        kv_mask = in_context[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFTCAP:
            scores = soft_cap(scores, softcap)
        visible = in_context[None, :] & (pos[None, :] <= q_pos[:, None]) \
            & ((window == 0) | (pos[None, :] > q_pos[:, None] - window))
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)    # a tile row that sees no key yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    out_offsets = (q_start + qi).to(tl.int64)[:, None] * stride_ot + (kv_head * GROUP + g)[:, None] * stride_oh \
        + d[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def prefill_block_m(group_pad: int) -> int:
    """Queries per tile: 64 tile rows of (query, group head), at least 16 for tl.dot."""
    return max(1, 64 // group_pad)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            max_seqlen_q: int, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [tokens, heads, dim] (each row's new tokens, whose K/V are already in the cache); caches
    [blocks, block_size, kv_heads, dim]; int32 cu_seqlens_q [rows+1] and context_lens [rows] (cached + new);
    window, softcap: the layer's sliding window and logit cap (0: none). Returns [tokens, heads, dim]."""
    tokens, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    rows = context_lens.shape[0]
    group = heads // kv_heads
    group_pad, dim_pad = triton.next_power_of_2(group), max(16, triton.next_power_of_2(dim))
    block_m = prefill_block_m(group_pad)
    out = torch.empty_like(q)
    grid = (rows, triton.cdiv(max_seqlen_q, block_m), kv_heads)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, scale, window, softcap,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=dim, HEAD_DIM_PAD=dim_pad, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SOFTCAP=softcap > 0, num_warps=NUM_WARPS)
    return out
