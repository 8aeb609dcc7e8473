"""Array mirror of the sequences in back-to-back decode steps.

A decode step changes each row by one token, so rank 0 keeps the batch as numpy arrays and builds the next
StepPlan with a few vectorized operations; Python touches only the rows that cross a block boundary, fill
a block or finish. The scheduler drops the batch whenever its running queue changes some other way
(a prefill, a preemption), and rebuilds it from the Sequence objects on the next decode step.
"""
import numpy as np

from nanovllm_tp.scheduler.plan import DECODE, StepPlan, lora_slots, slot_mapping
from nanovllm_tp.scheduler.rows import SamplingBatch, rows_of
from nanovllm_tp.scheduler.sequence import Sequence

_WIDTH_HEADROOM = 8    # spare block-table columns, so growing sequences rarely force a resize


class DecodeBatch:
    def __init__(self, seqs: list[Sequence], block_size: int):
        self.seqs = seqs
        self.block_size = block_size
        n = len(seqs)
        self.positions = np.fromiter((s.num_tokens - 1 for s in seqs), np.int64, n)   # of the token to compute
        self.last_tokens = np.fromiter((s.token_ids[-1] for s in seqs), np.int64, n)
        self.num_blocks = np.fromiter((len(s.block_table) for s in seqs), np.int64, n)
        self.block_tables = np.full((n, int(self.num_blocks.max()) + _WIDTH_HEADROOM), -1, np.int32)
        for i, s in enumerate(seqs):
            self.block_tables[i, :len(s.block_table)] = s.block_table
        self.completion = np.fromiter((s.num_completion_tokens for s in seqs), np.int64, n)
        self.rows = rows_of(seqs)        # sampling knobs and stop limits (scheduler/rows.py)
        self.lora_slot = lora_slots(seqs)

    def __len__(self) -> int:
        return len(self.seqs)

    def rows_needing_block(self) -> np.ndarray:
        return np.flatnonzero(self.positions >= self.num_blocks * self.block_size)

    def add_block(self, row: int, block_id: int) -> None:
        col = int(self.num_blocks[row])
        if col >= self.block_tables.shape[1]:
            pad = np.full((len(self), _WIDTH_HEADROOM), -1, np.int32)
            self.block_tables = np.concatenate((self.block_tables, pad), axis=1)
        self.block_tables[row, col] = block_id
        self.num_blocks[row] += 1

    def plan(self, step_id: int) -> StepPlan:
        n, bs, pos = len(self), self.block_size, self.positions
        slots = slot_mapping(self.block_tables, np.arange(n), pos, bs)
        return StepPlan(step_id=step_id, kind=DECODE, input_ids=self.last_tokens.copy(), positions=pos.copy(),
                        slot_mapping=slots, cu_seqlens_q=np.arange(n + 1, dtype=np.int32),
                        context_lens=(pos + 1).astype(np.int32),
                        block_tables=self.block_tables[:, :int(self.num_blocks.max())].copy(),
                        lora_slot=None if self.lora_slot is None else self.lora_slot.copy())

    def sampling(self) -> SamplingBatch:
        return SamplingBatch(self.seqs, self.rows, self.completion.copy())

    def advance(self, tokens: np.ndarray) -> None:
        """Every row computed its token and sampled the next one."""
        self.positions += 1
        self.last_tokens = tokens
        self.completion += 1

    def keep(self, mask: np.ndarray) -> None:
        """Drop the rows where mask is False (finished sequences)."""
        self.seqs = [s for s, k in zip(self.seqs, mask.tolist()) if k]
        for name in ("positions", "last_tokens", "num_blocks", "block_tables", "completion", "rows"):
            setattr(self, name, getattr(self, name)[mask])
        if self.lora_slot is not None:
            self.lora_slot = self.lora_slot[mask]
            if (self.lora_slot < 0).all():
                self.lora_slot = None
