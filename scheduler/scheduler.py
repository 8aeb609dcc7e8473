"""Decides who runs each step, under a token and a sequence budget. Torch-free.

Running sequences come first: each computes its next token. Waiting sequences fill what is left of the budget
in the same step (a mixed step, as vLLM V1 schedules), so a new prompt never pauses the decodes in flight.
Otherwise as nano-vllm: strict FCFS on the waiting queue, only the first prefill of a step may be chunked,
decode preempts the tail of the running queue by recompute when blocks run out. Back-to-back pure decode
steps take a vectorized fast path (DecodeBatch).

This file holds the queues and the step's shape; the mixins beside it make the decisions (admission.py,
preemption.py) and write the results back (postprocess.py).
"""
import time
from collections import deque
from dataclasses import dataclass, fields

import numpy as np

from nanovllm_tp.config.engine_config import EngineConfig
from nanovllm_tp.scheduler import policy
from nanovllm_tp.scheduler.admission import Admission
from nanovllm_tp.scheduler.block_manager import BlockManager, check_holds_a_sequence
from nanovllm_tp.scheduler.decode_batch import DecodeBatch
from nanovllm_tp.scheduler.lora_slots import LoRASlots
from nanovllm_tp.scheduler.plan import DECODE, MIXED, PREFILL
from nanovllm_tp.scheduler.postprocess import StepResults
from nanovllm_tp.scheduler.preemption import Preemption
from nanovllm_tp.scheduler.prefill_step import prefill_step
from nanovllm_tp.scheduler.scheduled_step import ScheduledStep
from nanovllm_tp.scheduler.sequence import Sequence, SequenceStatus
from nanovllm_tp.scheduler.speculative import NgramProposer, Proposer, SpeculativeConfig, attach_drafts

_ENGINE = {f.name: f.default for f in fields(EngineConfig)}    # the knobs' defaults, declared there


@dataclass(slots=True)
class SchedulerConfig:
    """The scheduler's part of the EngineConfig, and what the engine learnt building the KV cache."""
    num_kvcache_blocks: int
    kvcache_block_size: int
    max_model_len: int
    max_num_seqs: int = _ENGINE["max_num_seqs"]
    max_num_batched_tokens: int = _ENGINE["max_num_batched_tokens"]
    enable_prefix_caching: bool = _ENGINE["enable_prefix_caching"]
    eos_token_ids: tuple[int, ...] = ()
    speculative: SpeculativeConfig | None = None
    kv_window: int = 0      # the most recent tokens any layer reads (0: some layer reads everything)
    scheduling_policy: str = _ENGINE["scheduling_policy"]
    max_loras: int = 0      # LoRA slots (0: LoRA off)

    @classmethod
    def of(cls, config: EngineConfig, num_kvcache_blocks: int) -> "SchedulerConfig":
        """From a validated EngineConfig (block size and max_model_len resolved)."""
        windows = config.model_config.layer_windows
        return cls(num_kvcache_blocks, config.kvcache_block_size, config.max_model_len, config.max_num_seqs,
                   config.max_num_batched_tokens, config.enable_prefix_caching, config.model_config.eos_token_ids,
                   SpeculativeConfig.from_dict(config.speculative_config, config.tensor_parallel_size),
                   max(windows) if windows and all(windows) else 0, config.scheduling_policy,
                   config.max_loras if config.enable_lora else 0)


class Scheduler(Admission, Preemption, StepResults):
    """The queues, the block pool and the step in flight; its parts: admission.py (waiting prompts into a step),
    preemption.py (decode rows, recompute), postprocess.py (the step's results into the sequences)."""

    def __init__(self, config: SchedulerConfig, proposer: Proposer | None = None,
                 block_manager: BlockManager | None = None):
        """`proposer`: where proposals come from (default: the n-gram lookup when speculative decoding is on; a
        draft model's proposer is made beside the runner and handed in). `block_manager`: a pool shared with
        other schedulers (pipeline micro-batches, micro_batches.py); then a step that cannot run for want of
        blocks the others hold is no stall: schedule() returns None."""
        self.config = config
        spec = config.speculative
        if proposer is None and spec is not None and spec.method == "ngram":
            proposer = NgramProposer(spec)
        self.proposer = proposer
        self.block_size = config.kvcache_block_size
        check_holds_a_sequence(config.num_kvcache_blocks, self.block_size, config.max_model_len)
        self.shares_pool = block_manager is not None
        self.block_manager = block_manager or BlockManager(config.num_kvcache_blocks, self.block_size,
                                                           config.enable_prefix_caching, config.kv_window)
        self.eos = frozenset(config.eos_token_ids)
        self.by_priority = config.scheduling_policy == "priority"
        self.lora_slots = LoRASlots(config.max_loras) if config.max_loras else None
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.scheduled: list[Sequence] = []
        self.scheduled_kind = PREFILL
        self.decode_batch: DecodeBatch | None = None    # valid while decode steps follow each other
        self.in_flight: ScheduledStep | None = None      # between schedule() and postprocess()
        self._copies: list[tuple[int, int]] = []         # block copies the next plan carries (forks)
        self._eos_array = np.array(sorted(self.eos), dtype=np.int64)
        self.step_id = 0
        self.num_preemptions = 0
        self.num_mixed_steps = 0
        self.num_computed_tokens = 0    # lifetime: tokens run through the model (prompt chunks and decodes)
        self.num_draft_tokens = self.num_accepted_tokens = 0    # speculative decoding: proposed, accepted
        # accepted proposals by their place in the draft (vLLM's spec_decode_num_accepted_tokens_per_pos)
        self.num_accepted_per_position = np.zeros(spec.num_speculative_tokens if spec else 0, np.int64)

    def add(self, seq: Sequence) -> None:
        """Queue a request; its n > 1 siblings (seq.forks) start from its prompt KV when its prefill ends."""
        longest = self.config.max_model_len - (seq.pooling is None)     # an embedding needs no room for output
        if not 0 < seq.num_tokens <= longest:
            raise ValueError(f"sequence {seq.seq_id} has {seq.num_tokens} tokens; it needs 1 to "
                             f"{longest} (max_model_len={self.config.max_model_len})")
        policy.enqueue(self.waiting, seq, self.by_priority, front=False)

    def adopt(self, seq: Sequence, write) -> bool:
        """A decoding sequence that comes with its KV from another engine (engine/kv_transfer.py): all but its
        last token computed there. It takes blocks for those tokens (the prefix cache's where this pool holds the
        leading ones), `write(positions, block_ids)` fills the others (positions in its block table, which are
        the payload's), its full blocks enter the prefix cache as if computed here, and it decodes its next token
        in the next step; a LoRA sequence takes its adapter's slot (loaded by the next plan) as admission gives it.
        False, with nothing taken, when the pool or the LoRA slots are short, or when `write` returns False (the KV
        could not be read after all): the caller then queues it to compute its tokens again, as after a
        preemption."""
        if self.scheduled:
            raise RuntimeError("adopt() between schedule() and postprocess()")
        bm = self.block_manager
        if not 0 < seq.num_tokens < self.config.max_model_len or not self._slot_for(seq, take=True):
            return False
        positions = bm.allocate_imported(seq, seq.num_tokens - 1)
        if positions is None:
            self._free(seq)
            return False
        try:
            unread = write(positions, [seq.block_table[i] for i in positions]) is False
        except BaseException:
            self._free(seq)
            raise
        if unread:
            self._free(seq)
            return False
        if bm.enable_prefix_caching:
            for i in range(seq.num_cached_tokens // self.block_size):
                bm.hash_block(seq, i)
        bm.release_outside_window(seq)
        seq.status = SequenceStatus.RUNNING
        seq.first_token_time = seq.last_token_time = time.perf_counter()
        self.running.append(seq)
        self.decode_batch = None
        return True

    @staticmethod
    def mark_aborted(seq: Sequence) -> None:
        """A sequence that finished in the step just run ends as "abort" instead: its grammar failed in that step
        (the EOS a failed grammar mask leaves is no end of its structured output)."""
        seq.finish_reason, seq.stop_reason = "abort", None

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None,
               num_completion_tokens: int | None = None) -> None:
        """End a sequence from outside (abort, a stop string): it leaves its queue, its blocks are freed at once,
        and siblings it has not started yet end with it. A stop string found in the tokens of the step that just
        finished it by length makes it a "stop"; `num_completion_tokens` drops the tokens after the stop."""
        if num_completion_tokens is not None:
            del seq.token_ids[seq.num_prompt_tokens + num_completion_tokens:]
        if seq.is_finished:
            if reason == "stop" and isinstance(stop_reason, str):
                seq.finish_reason, seq.stop_reason = reason, stop_reason
            return
        if self.scheduled:
            raise RuntimeError("finish() between schedule() and postprocess()")
        for child in seq.forks:
            self.finish(child, reason, stop_reason)
        seq.forks = []
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.decode_batch = None
        if seq.block_table:
            self._free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason, seq.finish_time = reason, stop_reason, time.perf_counter()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        """The next step (its plan, sampling entries and prompt chunks), or None when nothing is left to run."""
        if self.scheduled:
            raise RuntimeError("schedule() called twice without postprocess()")
        if self.by_priority and self.waiting and self.running:
            self._preempt_for_head()
        if self.waiting and (not self.running or self._waiting_head_fits()):
            decodes = self._schedule_decode() if self.running else []
            seqs = decodes + self._schedule_prefill(reserved=len(decodes))
            if seqs:
                self.num_mixed_steps += bool(decodes)
                return self._step_of(seqs, MIXED if decodes else PREFILL)
        batch, proposer = self.decode_batch, self.proposer
        if proposer is not None and (limits := proposer.limits(self.running)):
            seqs = self._schedule_decode()
            if attach_drafts(seqs, limits, proposer, self.block_manager, self.config, self._copies):
                return self._step_of(seqs, MIXED)
            batch = self.decode_batch = DecodeBatch(seqs, self.block_size) if seqs else None
        elif batch is not None and not self._grow(batch):
            batch = None
        if batch is None:
            seqs = self._schedule_decode()
            if not seqs:
                if self.has_unfinished() and not self.shares_pool:
                    raise RuntimeError(f"scheduler stalled with {len(self.waiting)} waiting and "
                                       f"{len(self.running)} running sequences")
                return None
            batch = self.decode_batch = DecodeBatch(seqs, self.block_size)
        self.scheduled, self.scheduled_kind = batch.seqs, DECODE
        self.step_id += 1
        plan = batch.plan(self.step_id)
        plan.block_copies = self._take_copies()
        if self.lora_slots is not None:      # an adopted LoRA sequence's adapter (adopt) loads in a decode step
            plan.lora_loads = self.lora_slots.take_loads()
        self.num_computed_tokens += plan.num_tokens
        self.in_flight = ScheduledStep(plan, batch.sampling(), [])
        return self.in_flight

    def _step_of(self, seqs: list[Sequence], kind: int) -> ScheduledStep:
        """A prefill, mixed or speculative step of these rows (not the decode fast path)."""
        self.decode_batch = None
        self.scheduled, self.scheduled_kind = seqs, kind
        self.step_id += 1
        step = self.in_flight = prefill_step(seqs, kind, self.step_id, self.block_size, self._take_copies())
        if self.lora_slots is not None:
            step.plan.lora_loads = self.lora_slots.take_loads()
        self.num_computed_tokens += step.plan.num_tokens
        return step

    def _take_copies(self) -> np.ndarray | None:
        copies, self._copies = self._copies, []
        return np.asarray(copies, np.int32).reshape(-1, 2) if copies else None

    def _grow(self, batch: DecodeBatch) -> bool:
        """Give the batch's rows the blocks their next token needs; False when the pool is short (then the
        slow path preempts)."""
        rows = batch.rows_needing_block()
        if len(rows) > self.block_manager.num_free_blocks:
            return False
        for row in rows.tolist():
            block_id = self.block_manager.take_block()
            batch.seqs[row].block_table.append(block_id)
            batch.add_block(row, block_id)
        return True

    def _free(self, seq: Sequence) -> None:
        """seq gives back its blocks and its adapter's slot."""
        self.block_manager.deallocate(seq)
        if self.lora_slots is not None:
            self.lora_slots.release(seq)

    def abort_all(self) -> list[Sequence]:
        """Drop every unfinished sequence and free its blocks (used when a step fails)."""
        dropped = list(self.waiting) + [s for s in self.running if s not in self.waiting]
        dropped += [child for s in dropped for child in s.forks]
        for seq in dropped:
            seq.forks = []
            if seq.block_table:
                self._free(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        self.waiting.clear()
        self.running.clear()
        self.scheduled, self.in_flight, self._copies = [], None, []
        self.decode_batch = None
        return dropped
