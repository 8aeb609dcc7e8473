"""Per-rank CUDA graphs for decode, and KV sizing from free GPU memory after a warm-up forward.

Graphs are captured for a ladder of batch sizes; a decode step of n rows replays the smallest graph of at
least n rows. Padded rows have context length 0 and write their K/V into the reserved null slot, so replay
needs no branches. Inputs go through persistent pinned host buffers, one non-blocking copy each.
"""
import bisect
import logging
import math

import numpy as np
import torch

from nanovllm_tp.scheduler.plan import PREFILL, StepPlan
from nanovllm_tp.utils.context import Context, reset_context, set_context
from nanovllm_tp.workers.kv_cache import gpu_kv_budget

log = logging.getLogger("nanovllm_tp")


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
    """Host (pinned) and device copies of one decode step's inputs, sized for the largest graph.

    The block table the graphs read is `block_tables` [max_rows, width]; a step copies only the columns its
    plan uses (`rows * plan width` entries through a flat staging buffer, then one device-side copy), not the
    whole max_model_len width. Columns past a row's context are never read (attention stops at its length),
    so what earlier, wider steps left there does no harm."""

    def __init__(self, max_rows: int, width: int, device: torch.device):
        pin = device.type == "cuda"
        shapes = {"input_ids": ((max_rows,), torch.int64), "positions": ((max_rows,), torch.int64),
                  "slot_mapping": ((max_rows,), torch.int64), "context_lens": ((max_rows,), torch.int32),
                  "block_tables": ((max_rows * width,), torch.int32)}
        self.host = {k: torch.zeros(s, dtype=d, pin_memory=pin) for k, (s, d) in shapes.items()}
        self.device = {k: torch.zeros(s, dtype=d, device=device) for k, (s, d) in shapes.items()}
        self.block_tables = torch.full((max_rows, width), -1, dtype=torch.int32, device=device)
        self.width = width

    def fill(self, plan, rows: int, null_slot: int) -> None:
        """Write plan into the first `rows` host rows, padding the rest; then copy them to the device."""
        n, used = plan.num_rows, plan.block_tables.shape[1]
        if used > self.width:
            raise ValueError(f"a decode plan with {used} block-table columns; the graphs hold {self.width}")
        h = {k: v.numpy() for k, v in self.host.items()}
        h["input_ids"][:n] = plan.input_ids
        h["positions"][:n] = plan.positions
        h["slot_mapping"][:n] = plan.slot_mapping
        h["context_lens"][:n] = plan.context_lens
        table = h["block_tables"][:rows * used].reshape(rows, used)
        table[:n] = plan.block_tables
        table[n:] = -1
        h["input_ids"][n:rows] = 0
        h["positions"][n:rows] = 0
        h["slot_mapping"][n:rows] = null_slot
        h["context_lens"][n:rows] = 0
        for k in self.host:
            count = rows * used if k == "block_tables" else rows
            self.device[k][:count].copy_(self.host[k][:count], non_blocking=True)
        self.block_tables[:rows, :used].copy_(self.device["block_tables"][:rows * used].view(rows, used))

    def context(self, rows: int) -> Context:
        d = self.device
        return Context(is_prefill=False, slot_mapping=d["slot_mapping"][:rows], context_lens=d["context_lens"][:rows],
                       block_tables=self.block_tables[:rows])


class CUDAGraphRunner:
    """The decode graphs of one rank. It keeps the model and its own buffers, never the ModelRunner, so that
    dropping the runner frees graphs and KV cache at once (no reference cycle left for the collector)."""

    def __init__(self, runner, max_num_seqs: int, max_model_len: int):
        self.model, self.null_slot = runner.model, runner.null_slot
        self.sizes = graph_batch_sizes(max_num_seqs)
        width = block_table_width(max_model_len, runner.block_size)
        self.inputs = DecodeInputs(self.sizes[-1], width, runner.device)
        hidden_size = runner.model.hidden_size
        self.hidden = torch.zeros(self.sizes[-1], hidden_size, dtype=runner.dtype, device=runner.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        model, d, pool = self.model, self.inputs.device, None
        d["slot_mapping"].fill_(self.null_slot)
        try:
            for rows in reversed(self.sizes):     # largest first, so smaller graphs reuse its memory pool
                set_context(self.inputs.context(rows))
                self.hidden[:rows] = model(d["input_ids"][:rows], d["positions"][:rows])   # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.hidden[:rows] = model(d["input_ids"][:rows], d["positions"][:rows])
                pool = graph.pool()
                self.graphs[rows] = graph
        finally:
            reset_context()
        torch.cuda.synchronize()

    def release(self) -> None:
        """Free the graphs and their pool now: NCCL cannot destroy a communicator whose kernels a live graph
        captured (pytorch/pytorch#115388), so this runs before the process group goes."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.model = self.inputs = self.hidden = None

    def can_run(self, rows: int) -> bool:
        return rows <= self.sizes[-1]

    def replay(self, plan) -> torch.Tensor:
        rows = padded_batch_size(plan.num_rows, self.sizes)
        self.inputs.fill(plan, rows, self.null_slot)
        self.graphs[rows].replay()
        return self.hidden[:plan.num_rows]

    def run(self, plan) -> torch.Tensor | None:
        hidden = self.replay(plan)
        set_context(Context(is_prefill=False))
        try:
            return self.model.compute_logits(hidden)
        finally:
            reset_context()


def capture_decode_graphs(runner, max_num_seqs: int, max_model_len: int) -> CUDAGraphRunner | None:
    """Decode graphs for this runner, or None (decode runs eagerly) with a warning when capture raises,
    e.g. an attention kernel that syncs with the host (flash-attn newer than the checked range). Every rank
    runs the same kernels, so they fail at the same capture and stay in step."""
    graphs = CUDAGraphRunner(runner, max_num_seqs, max_model_len)
    try:
        graphs.capture()
    except Exception as exc:
        graphs.release()
        if runner.device.type == "cuda":
            try:
                torch.cuda.synchronize(runner.device)
                torch.cuda.empty_cache()
            except Exception:
                pass
        log.warning("CUDA graph capture failed (%s: %s); decode runs eagerly, as with enforce_eager=True",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
    return graphs


def profile_plans(config, block_size: int) -> list[StepPlan]:
    """The two steps that bound a step's activation memory, as the scheduler could send them: the longest
    prompts with nothing cached, and max_num_batched_tokens new tokens over max_model_len contexts (the last
    chunk of the longest prompt, with as many rows as allowed: prefix hits, mixed decode rows). Every row
    reads the same blocks 0.. of a cache that holds one max_model_len sequence."""
    tokens, max_len, max_rows = config.max_num_batched_tokens, config.max_model_len, config.max_num_seqs
    plain = ([max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else []))[:max_rows]
    rows = min(max_rows, tokens)
    q_lens, extra = [1] * rows, tokens - rows
    for row in range(rows):      # at most max_len - 1 new tokens, so each row has a cached prefix
        add = min(extra, max_len - 2)
        q_lens[row] += add
        extra -= add
    return [_profile_plan(plain, plain, block_size), _profile_plan(q_lens, [max_len] * rows, block_size)]


def _profile_plan(q_lens: list[int], context_lens: list[int], block_size: int) -> StepPlan:
    positions = np.concatenate([np.arange(c - q, c) for q, c in zip(q_lens, context_lens)]).astype(np.int64)
    rows, width = len(q_lens), -(-max(context_lens) // block_size)
    return StepPlan(step_id=0, kind=PREFILL, input_ids=np.zeros(len(positions), np.int64), positions=positions,
                    slot_mapping=positions.copy(),      # block b of the table is block b of the cache
                    cu_seqlens_q=np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32),
                    context_lens=np.asarray(context_lens, np.int32),
                    block_tables=np.tile(np.arange(width, dtype=np.int32), (rows, 1)))


@torch.inference_mode()
def run_profile_steps(runner, config, measure=None):
    """Run profile_plans over a temporary KV cache for one max_model_len sequence, then the sampler over a
    full decode batch; `measure()` is called (and returned) while that cache is still allocated."""
    runner.allocate_kv_cache(-(-config.max_model_len // runner.block_size))
    try:
        for plan in profile_plans(config, runner.block_size):
            runner.execute(plan)
        # The sampler's [rows, vocab] temporaries for a full decode batch count towards the peak too.
        from nanovllm_tp.layers.sampler import run_worst_case
        run_worst_case(runner.device, config.max_num_seqs, config.model_config.vocab_size, config.max_logprobs)
        return measure() if measure is not None else None
    finally:
        runner.drop_kv_cache()


def profile_kv_budget(runner, config) -> int:
    """Bytes left for KV under gpu_memory_utilization, after the weights and the activation peak of the
    worst steps (run_profile_steps)."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)

    def measure():
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)

    current, peak = run_profile_steps(runner, config, measure)     # current: weights + the temporary cache
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()     # cached activation blocks are free for KV; the peak above accounts for them
    free, total = torch.cuda.mem_get_info(device)
    return gpu_kv_budget(total, config.gpu_memory_utilization, total - free, peak - current)
