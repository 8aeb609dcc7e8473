"""Paged decode attention in Triton: the CUDA decode path when flash-attn is not installed.

One program per (row, kv head) walks the row's blocks with an online softmax, so it reads only the
row's own context (no gather, no padding to the longest row) and has static shapes for CUDA graphs.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, scale,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + row)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)     # tl.arange needs a power of two; head_dim 80 or 96 is masked
    s = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + g
    dim_mask = d < HEAD_DIM
    q_mask = (g < GROUP)[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask,
                other=0.0).to(tl.float32) * scale
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for page in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + row * stride_bt + page).to(tl.int64)
        in_context = page * BLOCK_SIZE + s < context_len
        offsets = block * stride_kb + s[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        kv_mask = in_context[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        scores = tl.where(in_context[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]     # rows with no context (graph padding) give zeros
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [rows, heads, dim]; caches [blocks, block_size, kv_heads, dim]; returns [rows, heads, dim]."""
    rows, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.empty_like(q)
    _paged_decode_kernel[(rows, kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=dim,
        HEAD_DIM_PAD=triton.next_power_of_2(dim), BLOCK_SIZE=block_size)
    return out
