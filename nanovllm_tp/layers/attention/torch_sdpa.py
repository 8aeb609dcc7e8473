"""`torch`: SDPA over K/V gathered from the paged cache. Runs on CPU and CUDA; the reference for the others. A
quantized cache is dequantized as it is gathered (kv_quant.py)."""
import torch
import torch.nn.functional as F

from nanovllm_tp.layers.attention.base import AttentionBackend, register_backend
from nanovllm_tp.layers.attention.kv_quant import ALL_KV_DTYPES, gather_blocks, gather_slots
from nanovllm_tp.utils.context import Context


AS_DECODE = 16     # a row of at most this many new tokens over cached KV runs as that many decode rows


@register_backend
class TorchBackend(AttentionBackend):
    """Prefill row by row through SDPA (rows of a few tokens over cached KV go through `decode`); decode over
    each row's blocks gathered from the cache."""
    name = "torch"
    devices = ("cpu", "cuda")
    supports_graphs = False     # decode reads host-side lengths, which a captured graph cannot
    kv_dtypes = ALL_KV_DTYPES
    reads_quantized = True
    every_row_as_decode = False     # batch_invariant: every prefill token as a decode row (config_checks.py)
    prompt_as_decode = 0            # a prefill row of at most this many tokens in all (cached + new): decode rows

    def prepare(self, ctx: Context) -> None:
        """A prefill step's rows of a few tokens over cached KV (a mixed step's decode rows, a speculative row's
        proposals) and its rows of at most `prompt_as_decode` tokens in all, each token as a decode row over the
        KV up to its own position (under batch_invariant, every prefill token: a query's result then never depends
        on how its prompt was chunked or cached): worked out once per step, not once per layer."""
        if not ctx.is_prefill or ctx.q_lens_cpu is None:
            return
        short, rows, tokens, lens, start = [], [], [], [], 0
        for row, (q_len, kv_len) in enumerate(zip(ctx.q_lens_cpu, ctx.context_lens_cpu)):
            if self.every_row_as_decode or kv_len <= self.prompt_as_decode or (q_len <= AS_DECODE and q_len < kv_len):
                short.append(row)
                rows += [row] * q_len
                tokens += range(start, start + q_len)
                lens += range(kv_len - q_len + 1, kv_len + 1)
            start += q_len
        if not short:
            ctx.as_decode = ()
            return
        device = ctx.block_tables.device
        # index None: the short rows are every token of the step, in order
        index = None if len(tokens) == start else torch.tensor(tokens, device=device)
        decode_ctx = Context(is_prefill=False, context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                             block_tables=ctx.block_tables[torch.tensor(rows, device=device)],
                             context_lens_cpu=lens)
        ctx.as_decode = (short, index, decode_ctx)

    def prefill(self, q, k, v, k_cache, v_cache, ctx, scale, window=0, softcap=0.0, kv_scales=None):
        if ctx.as_decode is None:
            self.prepare(ctx)          # a context made without the runner's prepare (the draft's, tests)
        short, index, decode_ctx = ctx.as_decode or ((), None, None)
        if short and index is None:    # a speculative step: every row is a few tokens over cached KV
            return self.decode(q, k_cache, v_cache, decode_ctx, scale, window, softcap, kv_scales)
        out = torch.empty_like(q)
        block_size = k_cache.shape[1] if k_cache.numel() else 0
        starts = [0]
        for q_len in ctx.q_lens_cpu:
            starts.append(starts[-1] + q_len)
        if short:
            out[index] = self.decode(q[index], k_cache, v_cache, decode_ctx, scale, window, softcap, kv_scales)
        done = set(short)
        for row, (q_len, kv_len) in enumerate(zip(ctx.q_lens_cpu, ctx.context_lens_cpu)):
            if row in done:
                continue
            start, prefix = starts[row], kv_len - q_len
            # keys from the first query's window on (all of them without a window); query j sits at prefix + j
            first = max(0, prefix - window + 1) if window else 0
            if kv_len == q_len:       # nothing cached before: attend to this step's own K/V
                ki, vi = k[start + first:start + q_len], v[start + first:start + q_len]
            else:
                slots = self._slots(ctx.block_tables[row:row + 1], block_size, kv_len)[0, first:]
                k_scale, v_scale = kv_scales or (None, None)
                ki = gather_slots(k_cache, k_scale, slots, q.dtype)
                vi = gather_slots(v_cache, v_scale, slots, q.dtype)
            mask = None
            if kv_len != q_len or softcap or 0 < window < q_len:
                q_pos = torch.arange(prefix, kv_len, device=q.device)[:, None]
                k_pos = torch.arange(first, kv_len, device=q.device)[None, :]
                mask = (k_pos <= q_pos) & (k_pos > q_pos - window) if window else k_pos <= q_pos
            qi = q[start:start + q_len]
            if softcap:
                out[start:start + q_len] = self._capped(qi, ki, vi, mask, scale, softcap)
            else:
                out[start:start + q_len] = self._sdpa(qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0), mask,
                                                      is_causal=mask is None, scale=scale)[0]
        return out

    def decode(self, q, k_cache, v_cache, ctx, scale, window=0, softcap=0.0, kv_scales=None):
        """Rows are grouped by context length (powers of two of blocks) so that gathering a group's K/V
        pads each row to at most twice its length, not to the longest row of the whole batch."""
        block_size = k_cache.shape[1]
        groups: dict[int, list[int]] = {}
        for row, length in enumerate(ctx.context_lens_cpu):
            groups.setdefault(1 << (-(-length // block_size) - 1).bit_length(), []).append(row)
        if len(groups) == 1:
            (blocks,) = groups
            return self._decode_rows(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, blocks, scale,
                                     window, softcap, kv_scales)
        out = torch.empty_like(q)
        for blocks, rows in groups.items():
            idx = torch.tensor(rows, device=q.device)
            out[idx] = self._decode_rows(q[idx], k_cache, v_cache, ctx.block_tables[idx], ctx.context_lens[idx],
                                         blocks, scale, window, softcap, kv_scales)
        return out

    @staticmethod
    def _decode_rows(q, k_cache, v_cache, block_tables, context_lens, blocks, scale, window=0, softcap=0.0,
                     kv_scales=None):
        rows, heads, dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        blocks = min(blocks, block_tables.shape[1])
        lens = context_lens.to(torch.long)[:, None]
        columns = torch.arange(blocks, device=q.device)[None, :]
        if window:      # only the blocks of each row's window: from the block of its first visible token on
            blocks = min(blocks, -(-window // block_size) + 1)
            columns = (lens - window).clamp(min=0) // block_size + columns[:, :blocks]
            last = ((lens - 1) // block_size).clamp(min=0)      # columns past the row's end read its last block
            table = block_tables.gather(1, torch.minimum(columns, last))
        else:
            table = block_tables[:, :blocks]
        table = table.clamp(min=0).flatten().to(torch.long)
        k_scale, v_scale = kv_scales or (None, None)
        k = gather_blocks(k_cache, k_scale, table, q.dtype).view(rows, blocks * block_size, kv_heads, dim)
        v = gather_blocks(v_cache, v_scale, table, q.dtype).view(rows, blocks * block_size, kv_heads, dim)
        # query heads that share a kv head are grouped on it, so K/V are never expanded for GQA
        qg = q.view(rows, kv_heads, heads // kv_heads, dim)
        scores = torch.einsum("rkgd,rskd->rkgs", qg, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        pos = (columns[:, :, None] * block_size + torch.arange(block_size, device=q.device)).flatten(1)
        hidden = pos >= lens
        if window:
            hidden |= pos < lens - window
        scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        return torch.einsum("rkgs,rskd->rkgd", probs, v).reshape(rows, heads, dim)

    @staticmethod
    def _capped(q, k, v, mask, scale, softcap):
        """Attention with soft-capped logits (SDPA has no cap): q [lq, h, d], k/v [lk, kvh, d], mask [lq, lk]."""
        lq, heads, dim = q.shape
        kv_heads = k.shape[1]
        qg = q.view(lq, kv_heads, heads // kv_heads, dim)
        scores = torch.tanh(torch.einsum("qkgd,skd->kgqs", qg, k) * scale / softcap) * softcap
        scores.masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        return torch.einsum("kgqs,skd->qkgd", probs, v).reshape(lq, heads, dim)

    @staticmethod
    def _slots(block_tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
        blocks = -(-length // block_size)
        table = block_tables[:, :blocks].clamp(min=0).to(torch.long)
        slots = table[:, :, None] * block_size + torch.arange(block_size, device=table.device)
        return slots.flatten(1)[:, :length]

    @staticmethod
    def _sdpa(q, k, v, mask, is_causal, scale):
        """q [b, lq, h, d], k/v [b, lk, kvh, d], mask broadcastable to [b, lq, lk] or None."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if mask is not None:
            mask = mask.unsqueeze(-3) if mask.dim() == 3 else mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2)
