"""Decides who runs each step, under a token and a sequence budget. Torch-free.

Running sequences come first: each computes its next token. Waiting sequences fill what is left of the budget
in the same step (a mixed step, as vLLM V1 schedules), so a new prompt never pauses the decodes in flight.
Otherwise as nano-vllm: strict FCFS on the waiting queue, only the first prefill of a step may be chunked,
decode preempts the tail of the running queue by recompute when blocks run out. Back-to-back pure decode
steps take a vectorized fast path (DecodeBatch).
"""
import time
from collections import deque
from dataclasses import dataclass, fields

import numpy as np

from nanovllm_tp.config import EngineConfig
from nanovllm_tp.scheduler import policy
from nanovllm_tp.scheduler.block_manager import BlockManager, check_holds_a_sequence
from nanovllm_tp.scheduler.decode_batch import DecodeBatch
from nanovllm_tp.scheduler.lora_slots import LoRASlots
from nanovllm_tp.scheduler.plan import DECODE, MIXED, PREFILL
from nanovllm_tp.scheduler.prefill_step import prefill_step
from nanovllm_tp.scheduler.rows import LENGTH, RUNNING, STOP_TOKEN, SamplingBatch, finish_codes
from nanovllm_tp.scheduler.scheduled_step import PoolChunk, ScheduledStep, TokenLogprobs
from nanovllm_tp.scheduler.sequence import Sequence, SequenceStatus
from nanovllm_tp.scheduler.speculative import (NgramProposer, Proposer, SpeculativeConfig, accept, attach_drafts,
                                               ordinals)

_REASONS = {LENGTH: "length"}    # every other finish code is "stop"


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


class Scheduler:
    def __init__(self, config: SchedulerConfig, proposer: Proposer | None = None):
        """`proposer`: where proposals come from (default: the n-gram lookup when speculative decoding is on; a
        draft model's proposer is made beside the runner and handed in)."""
        self.config = config
        spec = config.speculative
        if proposer is None and spec is not None and spec.method == "ngram":
            proposer = NgramProposer(spec)
        self.proposer = proposer
        self.block_size = config.kvcache_block_size
        check_holds_a_sequence(config.num_kvcache_blocks, self.block_size, config.max_model_len)
        self.block_manager = BlockManager(config.num_kvcache_blocks, self.block_size,
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
                if self.has_unfinished():
                    raise RuntimeError(f"scheduler stalled with {len(self.waiting)} waiting and "
                                       f"{len(self.running)} running sequences")
                return None
            batch = self.decode_batch = DecodeBatch(seqs, self.block_size)
        self.scheduled, self.scheduled_kind = batch.seqs, DECODE
        self.step_id += 1
        plan = batch.plan(self.step_id)
        plan.block_copies = self._take_copies()
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

    def _waiting_head_fits(self) -> bool:
        """Whether the next waiting sequence could join a step next to the running ones (else the step stays a
        pure decode step, on the fast path)."""
        cfg, head = self.config, self.waiting[0]
        if len(self.running) >= min(cfg.max_num_seqs, cfg.max_num_batched_tokens):
            return False
        if head.block_table:
            return True
        return self._slot_for(head) and self.block_manager.can_allocate(head) is not None

    def _slot_for(self, seq: Sequence, take: bool = False) -> bool:
        """Whether seq's adapter has (take: gets) a slot; always for the base model."""
        slots = self.lora_slots
        return seq.lora is None or slots is None or (slots.acquire(seq) if take else slots.can_acquire(seq))

    def _free(self, seq: Sequence) -> None:
        """seq gives back its blocks and its adapter's slot."""
        self.block_manager.deallocate(seq)
        if self.lora_slots is not None:
            self.lora_slots.release(seq)

    def _schedule_prefill(self, reserved: int = 0) -> list[Sequence]:
        """Waiting sequences for what is left after `reserved` decode rows (one token and one row each)."""
        cfg, bm = self.config, self.block_manager
        seqs, budget_used = [], reserved
        while self.waiting and len(seqs) + reserved < cfg.max_num_seqs:
            remaining = cfg.max_num_batched_tokens - budget_used
            if remaining == 0:
                break
            seq = self.waiting[0]
            hits = None
            if not seq.block_table:
                hits = bm.can_allocate(seq) if self._slot_for(seq) else None
                if hits is None:
                    break          # FCFS: nothing behind the head may jump it (nor a head short of a LoRA slot)
                num_tokens = seq.num_tokens - len(hits) * self.block_size
            else:
                num_tokens = seq.num_tokens - seq.num_cached_tokens
            if num_tokens > remaining and seqs:
                break              # only the first prefill of a step is chunked
            if hits is not None:
                self._slot_for(seq, take=True)
                bm.allocate(seq, hits)
            seq.num_scheduled_tokens = min(num_tokens, remaining)
            budget_used += seq.num_scheduled_tokens
            if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                seq.status = SequenceStatus.RUNNING
                self.waiting.popleft()
                self.running.append(seq)
            seqs.append(seq)
        return seqs

    def _schedule_decode(self) -> list[Sequence]:
        bm, seqs = self.block_manager, []
        max_rows = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)   # one token per row
        while self.running and len(seqs) < max_rows:
            seq = self.running.popleft()
            while not bm.can_append(seq):
                out = policy.victim(self.running, seq, self.by_priority)
                if out is seq:
                    self._preempt(seq)
                    break
                self.running.remove(out)
                self._preempt(out)
            else:
                seq.num_scheduled_tokens = 1
                bm.may_append(seq)
                seqs.append(seq)
        self.running.extendleft(reversed(seqs))
        return seqs

    def _requeue_front(self, seq: Sequence) -> None:
        """Back into waiting as the policy says (fcfs: its front), behind a prompt part-way through its chunks."""
        policy.enqueue(self.waiting, seq, self.by_priority, front=True)

    def _preempt_for_head(self) -> None:
        """Under priority: running sequences that rank below the head of waiting are preempted (lowest first) until
        the head can start."""
        head, cfg = self.waiting[0], self.config
        while not head.block_table:
            out = policy.lower_priority_running(self.running, head)     # first: cheaper than the head's hashes
            if out is None or (len(self.running) < cfg.max_num_seqs
                               and self.block_manager.can_allocate(head) is not None):
                return
            self.running.remove(out)
            self._preempt(out)

    def _preempt(self, seq: Sequence) -> None:
        self.decode_batch = None
        seq.embedding = None          # an embedding request recomputed starts its sum again
        seq.status = SequenceStatus.WAITING
        self._free(seq)
        self._requeue_front(seq)
        self.num_preemptions += 1

    def postprocess(self, token_ids: list[int], logprobs: TokenLogprobs | None = None,
                    prompt_logprobs: list[TokenLogprobs] | None = None, pooled=None) -> list[Sequence]:
        """Apply the step's results: one sampled token per sampling entry, the logprobs of the entries that asked
        for them (in entry order), those of each prompt chunk, and `pooled` (float32 [pool chunks, hidden]: each
        chunk's sum of the hidden states its pooling reads). Returns the sequences that got a token, and the
        embedding requests that finished (finished ones have status FINISHED and a finish_reason)."""
        step, self.in_flight = self.in_flight, None
        if step is None:
            raise RuntimeError("postprocess() without a scheduled step")
        seqs, self.scheduled = self.scheduled, []
        batch = step.sampling
        entries = batch.seqs
        if len(token_ids) != len(entries):
            raise RuntimeError(f"got {len(token_ids)} sampled tokens for {len(entries)} sampling rows")
        entry_lp = _entry_logprobs(batch, logprobs)
        for chunk, lp in zip(step.prompt_chunks, prompt_logprobs or ()):
            chunk.seq.prompt_logprobs.extend(lp.positions(chunk.seq.params.prompt_logprobs))
        if self.scheduled_kind == DECODE:
            if logprobs is not None:
                for seq, lp in zip(entries, entry_lp):
                    if lp is not None:
                        _add_logprob(seq, lp)
            return self._postprocess_decode(token_ids)
        bm, now = self.block_manager, time.perf_counter()
        for seq in entries:
            if seq.forks:
                for child in seq.forks:
                    self._start_fork(seq, child)
                seq.forks = []
        tokens, rows = np.asarray(token_ids, np.int64), batch.rows
        if self.scheduled_kind == MIXED and any(s.draft for s in seqs):    # a speculative step
            keep, proposed, accepted = accept(entries, tokens, self.num_accepted_per_position)
            self.num_draft_tokens, self.num_accepted_tokens = self.num_draft_tokens + proposed, \
                self.num_accepted_tokens + accepted
            kept = keep.tolist()
            entries, tokens, rows = [e for e, k in zip(entries, kept) if k], tokens[keep], rows[keep]
            entry_lp = [lp for lp, k in zip(entry_lp, kept) if k]
            ordinal = ordinals(entries)
        else:
            ordinal = np.zeros(len(entries), np.int64)
        completion = np.fromiter((s.num_completion_tokens for s in entries), np.int64, len(entries)) + ordinal + 1
        total = np.fromiter((s.num_tokens for s in entries), np.int64, len(entries)) + ordinal + 1
        codes = finish_codes(entries, rows, tokens, completion, total, self._eos_array, self.config.max_model_len)
        ended, progressed = {}, []
        for seq, token_id, code, lp in zip(entries, tokens.tolist(), codes.tolist(), entry_lp):
            if seq.seq_id in ended:
                continue                  # tokens after one that ended the sequence (a speculative row)
            seq.token_ids.append(token_id)
            if lp is not None:
                _add_logprob(seq, lp)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            if not progressed or progressed[-1] is not seq:
                progressed.append(seq)
            if code != RUNNING:
                ended[seq.seq_id] = (code, token_id)
        for seq in seqs:
            before = seq.num_cached_tokens
            # a speculative row's KV holds its last token and the accepted proposals: all but the new last token
            seq.num_cached_tokens = seq.num_tokens - 1 if seq.draft else before + seq.num_scheduled_tokens
            seq.num_scheduled_tokens = seq.num_cached_tokens - before
            bm.hash_blocks(seq)
            bm.release_outside_window(seq)
            seq.num_scheduled_tokens, seq.draft = 0, []
        for seq in progressed:
            if seq.seq_id in ended:
                self._finish(seq, *ended[seq.seq_id], now)
        for chunk, part in zip(step.pool_chunks, () if pooled is None else pooled):
            if self._pool(chunk, part, now):
                progressed.append(chunk.seq)
        return progressed

    def _pool(self, chunk: PoolChunk, part, now: float) -> bool:
        """Add an embedding request's chunk to its pooled sum; at the prompt's end make the embedding and finish
        the request (its blocks freed: no KV is kept for it). True when it finished."""
        seq = chunk.seq
        if len(chunk.token_rows):
            seq.embedding = part.copy() if seq.embedding is None else seq.embedding + part
        if not chunk.final:
            return False
        seq.embedding = seq.pooling.finish(seq.embedding, seq.num_prompt_tokens)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "stop"
        seq.first_token_time = seq.last_token_time = seq.finish_time = now
        self.block_manager.deallocate(seq)
        self.running.remove(seq)
        return True

    def _start_fork(self, parent: Sequence, child: Sequence) -> None:
        """A sibling of an n > 1 request joins with the parent's prompt KV: full blocks shared, the partly
        filled last block copied (the next plan carries the copy). Short of a block, it queues to recompute."""
        bm, bs = self.block_manager, self.block_size
        full = parent.num_prompt_tokens // bs
        partial = parent.num_prompt_tokens % bs != 0
        if partial and bm.num_free_blocks == 0:
            self._requeue_front(child)
            return
        for block_id in bm.live_blocks(parent)[:max(0, full - parent.num_window_freed)]:
            bm.share(block_id)
        child.block_table = parent.block_table[:full]
        child.num_window_freed = min(parent.num_window_freed, full)
        if partial:
            dst = bm.take_block()
            self._copies.append((parent.block_table[full], dst))
            child.block_table.append(dst)
        child.num_cached_tokens = parent.num_prompt_tokens
        self._slot_for(child, take=True)      # the parent's adapter, resident
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        self.decode_batch = None

    def _finish(self, seq: Sequence, code: int, token_id: int, now: float) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = _REASONS.get(code, "stop")
        seq.stop_reason = token_id if code == STOP_TOKEN else None
        seq.finish_time = now
        self._free(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)      # a fork that queued to recompute

    def _postprocess_decode(self, token_ids: list[int]) -> list[Sequence]:
        batch, bm, now = self.decode_batch, self.block_manager, time.perf_counter()
        for seq, token_id in zip(batch.seqs, token_ids):
            seq.token_ids.append(token_id)
            seq.num_cached_tokens += 1
            seq.last_token_time = now
        if bm.enable_prefix_caching:     # rows whose token just completed a block
            for row in np.flatnonzero((batch.positions + 1) % self.block_size == 0).tolist():
                bm.hash_block(batch.seqs[row], int(batch.positions[row]) // self.block_size)
        if bm.window:     # rows whose window just left a block behind
            for row in np.flatnonzero((batch.positions + 2 - bm.window) % self.block_size == 0).tolist():
                bm.release_outside_window(batch.seqs[row])
        tokens = np.asarray(token_ids, dtype=np.int64)
        progressed = batch.seqs
        batch.advance(tokens)
        codes = finish_codes(batch.seqs, batch.rows, tokens, batch.completion, batch.positions + 1,
                             self._eos_array, self.config.max_model_len)
        done = codes != RUNNING
        if not done.any():
            return progressed
        for row in np.flatnonzero(done).tolist():
            self._finish(batch.seqs[row], int(codes[row]), int(tokens[row]), now)
        batch.keep(~done)
        if len(batch) == 0 or len(self.running) > len(batch):
            self.decode_batch = None      # rows that were waiting for room in the batch join it next step
        return progressed

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


def _entry_logprobs(batch: SamplingBatch, lp: TokenLogprobs | None) -> list:
    """Per sampling entry: its token's PositionLogprob (the entries that asked for them come in entry order in
    `lp`), None for the others. Recorded only with the tokens kept (a rejected proposal's position is not)."""
    out = [None] * len(batch.seqs)
    if lp is None:
        return out
    entries = np.flatnonzero(batch.rows["logprobs"] >= 0)
    for e, position in zip(entries.tolist(), lp.positions(batch.rows["logprobs"][entries].tolist())):
        out[e] = position
    return out


def _add_logprob(seq: Sequence, position) -> None:
    seq.logprobs.append(position)
    seq.cumulative_logprob += position.logprob

