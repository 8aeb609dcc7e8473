"""A step's results written into its sequences: sampled tokens (speculative rows' proposals accepted or not),
logprobs, prompt logprobs, embeddings' pooled sums, n > 1 siblings started from their parent's prompt KV,
finish reasons and freed blocks; the vectorized form for back-to-back decode steps. A part of Scheduler."""
import time

import numpy as np

from nanovllm_tp.scheduler.plan import DECODE, MIXED
from nanovllm_tp.scheduler.rows import LENGTH, RUNNING, STOP_TOKEN, SamplingBatch, finish_codes
from nanovllm_tp.scheduler.scheduled_step import PoolChunk, TokenLogprobs
from nanovllm_tp.scheduler.sequence import Sequence, SequenceStatus
from nanovllm_tp.scheduler.speculative import accept, ordinals

_REASONS = {LENGTH: "length"}    # every other finish code is "stop"


class StepResults:
    """Mixed into Scheduler: uses the step in flight, its queues, block manager and counters."""

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
