"""Per-rank CUDA graphs for decode, and KV sizing from free GPU memory after a warm-up forward.

Graphs are captured for a ladder of batch sizes; a decode step of n rows replays the smallest graph of at
least n rows. Padded rows have context length 0 and write their K/V into the reserved null slot, so replay
needs no branches. Inputs go through persistent pinned host buffers, one non-blocking copy each.
"""
import bisect
import math

import numpy as np
import torch

from nanovllm_tp.context import Context, reset_context, set_context
from nanovllm_tp.workers.kv_cache import gpu_kv_budget


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs, which is always included."""
    sizes = {s for s in (1, 2, 4, 8) if s < max_num_seqs} | set(range(16, max_num_seqs, 16)) | {max_num_seqs}
    return sorted(sizes)


def padded_batch_size(rows: int, sizes: list[int]) -> int | None:
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


def block_table_width(max_model_len: int, block_size: int) -> int:
    return math.ceil(max_model_len / block_size)


class DecodeInputs:
    """Host (pinned) and device copies of one decode step's inputs, sized for the largest graph."""

    def __init__(self, max_rows: int, width: int, device: torch.device):
        pin = device.type == "cuda"
        shapes = {"input_ids": ((max_rows,), torch.int64), "positions": ((max_rows,), torch.int64),
                  "slot_mapping": ((max_rows,), torch.int64), "context_lens": ((max_rows,), torch.int32),
                  "block_tables": ((max_rows, width), torch.int32)}
        self.host = {k: torch.zeros(s, dtype=d, pin_memory=pin) for k, (s, d) in shapes.items()}
        self.device = {k: torch.zeros(s, dtype=d, device=device) for k, (s, d) in shapes.items()}
        self.width = width

    def fill(self, plan, rows: int, null_slot: int) -> None:
        """Write plan into the first `rows` host rows, padding the rest; then copy them to the device."""
        n = plan.num_rows
        h = {k: v.numpy() for k, v in self.host.items()}
        h["input_ids"][:n] = plan.input_ids
        h["positions"][:n] = plan.positions
        h["slot_mapping"][:n] = plan.slot_mapping
        h["context_lens"][:n] = plan.context_lens
        table = h["block_tables"]
        table[:rows] = -1
        table[:n, :plan.block_tables.shape[1]] = plan.block_tables
        h["input_ids"][n:rows] = 0
        h["positions"][n:rows] = 0
        h["slot_mapping"][n:rows] = null_slot
        h["context_lens"][n:rows] = 0
        for k in self.host:
            self.device[k][:rows].copy_(self.host[k][:rows], non_blocking=True)

    def context(self, rows: int) -> Context:
        d = self.device
        return Context(is_prefill=False, slot_mapping=d["slot_mapping"][:rows], context_lens=d["context_lens"][:rows],
                       block_tables=d["block_tables"][:rows])


class CUDAGraphRunner:
    def __init__(self, runner, max_num_seqs: int, max_model_len: int):
        self.runner = runner
        self.sizes = graph_batch_sizes(max_num_seqs)
        width = block_table_width(max_model_len, runner.block_size)
        self.inputs = DecodeInputs(self.sizes[-1], width, runner.device)
        hidden_size = runner.model.hidden_size
        self.hidden = torch.zeros(self.sizes[-1], hidden_size, dtype=runner.dtype, device=runner.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        model, d, pool = self.runner.model, self.inputs.device, None
        d["slot_mapping"].fill_(self.runner.null_slot)
        for rows in reversed(self.sizes):     # largest first, so smaller graphs reuse its memory pool
            set_context(self.inputs.context(rows))
            self.hidden[:rows] = model(d["input_ids"][:rows], d["positions"][:rows])   # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.hidden[:rows] = model(d["input_ids"][:rows], d["positions"][:rows])
            pool = graph.pool()
            self.graphs[rows] = graph
            reset_context()
        torch.cuda.synchronize()

    def can_run(self, rows: int) -> bool:
        return rows <= self.sizes[-1]

    def replay(self, plan) -> torch.Tensor:
        rows = padded_batch_size(plan.num_rows, self.sizes)
        self.inputs.fill(plan, rows, self.runner.null_slot)
        self.graphs[rows].replay()
        return self.hidden[:plan.num_rows]

    def run(self, plan) -> torch.Tensor | None:
        hidden = self.replay(plan)
        set_context(Context(is_prefill=False))
        try:
            return self.runner.model.compute_logits(hidden)
        finally:
            reset_context()


@torch.inference_mode()
def profile_kv_budget(runner, config) -> int:
    """Bytes left for KV after a forward of max_num_batched_tokens tokens, under gpu_memory_utilization."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    tokens, max_len = config.max_num_batched_tokens, config.max_model_len
    q_lens = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
    cu = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32)
    cu_t = torch.from_numpy(cu).to(device)
    set_context(Context(is_prefill=True, cu_seqlens_q=cu_t, cu_seqlens_k=cu_t, max_seqlen_q=max(q_lens),
                        max_seqlen_k=max(q_lens), context_lens=torch.tensor(q_lens, dtype=torch.int32, device=device),
                        has_cached_prefix=False, context_lens_cpu=q_lens, q_lens_cpu=q_lens))
    positions = torch.cat([torch.arange(n, device=device) for n in q_lens])
    try:
        runner.model.compute_logits(runner.model(torch.zeros(tokens, dtype=torch.long, device=device), positions))
    finally:
        reset_context()
    # The sampler's [rows, vocab] temporaries for a full decode batch count towards the peak too.
    rows, vocab = config.max_num_seqs, config.model_config.vocab_size
    runner.sampler(torch.zeros(rows, vocab, device=device), torch.ones(rows, device=device),
                   torch.arange(rows, device=device), torch.zeros(rows, dtype=torch.int64, device=device))
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()     # cached activation blocks are free for KV; the peak below accounts for them
    free, total = torch.cuda.mem_get_info(device)
    current, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    return gpu_kv_budget(total, config.gpu_memory_utilization, total - free, peak - current)
