"""Every rank checks each decoded plan against its own limits before any kernel reads it.

A plan that passes touches only this rank's memory: token ids index the embedding, positions the
rotary table, slots and block ids the KV pool, and every length agrees with the arrays. One that
does not raises PlanError naming the step and the field. Vectorized and branch-light (a few
microseconds at 256 rows; ``bench/step.py`` measures it). Fields it does not know are ignored.
"""
from dataclasses import dataclass

import numpy as np

from nanovllm_tp.scheduler.plan import DECODE, KV_READ, KV_WRITE, MIXED, PREFILL, PlanError, StepPlan

_PER_ROW = ("prompt_logits", "hidden_rows", "lora_slot")     # optional per-row arrays


@dataclass(slots=True)
class PlanLimits:
    num_blocks: int        # usable KV blocks of this rank (the null block is the runner's, never a plan's)
    block_size: int
    max_model_len: int
    vocab_size: int
    max_loras: int = 0     # LoRA slots (0: LoRA off, no plan may name one)

    @classmethod
    def of(cls, runner) -> "PlanLimits":
        config = runner.config
        return cls(runner.num_kv_blocks, config.kvcache_block_size, config.max_model_len,
                   config.model_config.vocab_size, config.max_loras if config.enable_lora else 0)


def _bad(plan: StepPlan, field: str, text: str):
    raise PlanError(plan.step_id, field, text)


def _below(plan: StepPlan, field: str, values: np.ndarray, limit: int, what: str) -> None:
    """0 <= values < limit, in one reduction (negatives wrap to huge unsigned values)."""
    if len(values) and values.view(np.uint64 if values.itemsize == 8 else np.uint32).max() >= limit:
        bad = values[(values < 0) | (values >= limit)][0]
        _bad(plan, field, f"{bad} outside [0, {limit}) ({what})")


def check_plan(plan: StepPlan, lim: PlanLimits) -> None:
    kind, ids, cu, ctx, tables = plan.kind, plan.input_ids, plan.cu_seqlens_q, plan.context_lens, plan.block_tables
    if kind in (KV_READ, KV_WRITE):
        return _check_kv_move(plan, lim)
    if kind not in (PREFILL, DECODE, MIXED):
        _bad(plan, "kind", f"unknown step kind {kind}")
    if plan.kv_blocks is not None:
        _bad(plan, "kv_blocks", "only a KV_READ or KV_WRITE plan names blocks to move")
    rows, tokens = len(ctx), len(ids)
    if rows == 0 or tokens == 0:
        _bad(plan, "context_lens", f"an empty step ({rows} rows, {tokens} tokens)")
    for name in ("positions", "slot_mapping"):
        if len(getattr(plan, name)) != tokens:
            _bad(plan, name, f"{len(getattr(plan, name))} entries for {tokens} tokens")
    if len(cu) != rows + 1 or tables.shape[0] != rows:
        _bad(plan, "cu_seqlens_q" if len(cu) != rows + 1 else "block_tables",
             f"{len(cu)} cu_seqlens entries / {tables.shape[0]} block-table rows for {rows} rows")
    for name in _PER_ROW:
        value = getattr(plan, name, None)
        if value is not None and len(value) != rows:
            _bad(plan, name, f"{len(value)} entries for {rows} rows")
    copies = plan.block_copies
    if copies is not None:
        if copies.ndim != 2 or copies.shape[1] != 2:
            _bad(plan, "block_copies", f"expected [copies, 2], got shape {list(copies.shape)}")
        _below(plan, "block_copies", copies.reshape(-1), lim.num_blocks, "the KV pool's blocks")
    _check_lora(plan, lim)
    q_lens = cu[1:] - cu[:-1]      # no wrap-around once every entry is known to lie in [0, tokens]
    if cu[0] != 0 or cu[-1] != tokens or cu.view(np.uint32).max() > tokens or q_lens.min() < 1:
        _bad(plan, "cu_seqlens_q", f"must rise strictly from 0 to the token count {tokens}")
    if kind == DECODE and tokens != rows:
        _bad(plan, "cu_seqlens_q", f"a decode step has one token per row, got {tokens} for {rows} rows")
    _below(plan, "input_ids", ids, lim.vocab_size, "the vocabulary")
    _below(plan, "positions", plan.positions, lim.max_model_len, "max_model_len")
    _below(plan, "slot_mapping", plan.slot_mapping, lim.num_blocks * lim.block_size, "the KV pool's slots")
    # Context lengths: within max_model_len and within what the block-table row can address.
    ctx_limit = min(lim.max_model_len, tables.shape[1] * lim.block_size)
    if ctx.view(np.uint32).max() > ctx_limit or (ctx - q_lens).min() < 0:
        if 0 < ctx.min() and ctx.max() <= lim.max_model_len and (ctx - q_lens).min() >= 0:
            _bad(plan, "block_tables", f"{tables.shape[1]} columns of {lim.block_size} tokens cannot hold a "
                                       f"context of {ctx.max()}")
        _bad(plan, "context_lens", f"each row needs new tokens <= context length <= max_model_len "
                                   f"{lim.max_model_len}")
    # Block tables: where a row's context reaches (what the attention kernels read) a block of the pool,
    # elsewhere a block or -1 (padding). One reduction: padding columns are shifted up by one, so both
    # become "0 <= value <= num_blocks" (num_blocks itself is the runner's null block: harmless).
    padding = np.arange(tables.shape[1], dtype=np.int32) >= ((ctx + (lim.block_size - 1)) // lim.block_size)[:, None]
    if (tables + padding).view(np.uint32).max() > lim.num_blocks:
        _bad(plan, "block_tables", f"a block id outside the KV pool's {lim.num_blocks} blocks, or padding (-1) "
                                   "where the row's context reaches")


def _check_kv_move(plan: StepPlan, lim: PlanLimits) -> None:
    """A plan that moves KV: no rows, no tokens, and one or more distinct blocks of the pool."""
    blocks = plan.kv_blocks
    if len(plan.context_lens) or len(plan.input_ids) or plan.block_copies is not None or plan.lora_loads:
        _bad(plan, "kind", "a KV_READ or KV_WRITE plan runs no rows")
    if blocks is None or not len(blocks):
        _bad(plan, "kv_blocks", "a KV_READ or KV_WRITE plan names one or more blocks")
    _below(plan, "kv_blocks", blocks, lim.num_blocks, "the KV pool's blocks")
    if plan.kind == KV_WRITE and len(np.unique(blocks)) != len(blocks):
        _bad(plan, "kv_blocks", "a block written twice in one KV_WRITE")


def _check_lora(plan: StepPlan, lim: PlanLimits) -> None:
    """Row slots in [-1, max_loras), loads into a slot of this rank's tables from an absolute path."""
    if plan.lora_slot is not None:
        _below(plan, "lora_slot", plan.lora_slot + 1, lim.max_loras + 1, "-1 or a LoRA slot")
    for slot, lora_id, path in plan.lora_loads or ():
        if not 0 <= slot < lim.max_loras or lora_id < 1 or not path.startswith("/"):
            _bad(plan, "lora_loads", f"[{slot}, {lora_id}, {path[:80]!r}]: needs a slot below max_loras="
                                     f"{lim.max_loras}, a positive id and an absolute path")
