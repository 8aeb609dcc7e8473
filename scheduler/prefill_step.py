"""The plan of a step that is not pure decode: prompt chunks over cached prefixes, and in mixed steps decode
rows too (one new token over num_tokens - 1 cached, and in a speculative step the row's proposed tokens after
it). Pure decode plans come from DecodeBatch."""
import numpy as np

from nanovllm_tp.pooling.params import CLS, MEAN
from nanovllm_tp.scheduler.plan import StepPlan, lora_slots, slot_mapping
from nanovllm_tp.scheduler.rows import SamplingBatch, rows_of
from nanovllm_tp.scheduler.scheduled_step import PoolChunk, PromptChunk, ScheduledStep
from nanovllm_tp.scheduler.sequence import Sequence


def prefill_step(seqs: list[Sequence], kind: int, step_id: int, block_size: int,
                 block_copies: np.ndarray | None) -> ScheduledStep:
    """The step of the scheduled rows: its plan, its sampling entries, and the prompt chunks of the rows whose
    every token gets logits (prompt logprobs). A row with proposed tokens (seq.draft) computes them after its last
    token and samples at each of its positions."""
    rows = len(seqs)
    q_lens = np.fromiter((s.num_scheduled_tokens for s in seqs), np.int32, rows)
    starts = np.fromiter((s.num_cached_tokens for s in seqs), np.int64, rows)
    width = max(len(s.block_table) for s in seqs)
    block_tables = np.full((rows, width), -1, np.int32)
    for i, s in enumerate(seqs):
        block_tables[i, :len(s.block_table)] = s.block_table
    input_ids = np.fromiter((t for s in seqs for t in (s.token_ids[s.num_cached_tokens:] + s.draft if s.draft else
                             s.token_ids[s.num_cached_tokens:s.num_cached_tokens + s.num_scheduled_tokens])),
                            np.int64, int(q_lens.sum()))
    row_of_token = np.repeat(np.arange(rows), q_lens)
    cu_seqlens_q = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32)
    positions = starts[row_of_token] + (np.arange(len(input_ids)) - cu_seqlens_q[row_of_token])
    slots = slot_mapping(block_tables, row_of_token, positions, block_size)
    prompt = np.fromiter((s.wants_prompt_logits for s in seqs), np.bool_, rows)
    all_logits = prompt | np.fromiter((bool(s.draft) for s in seqs), np.bool_, rows)
    pool = np.fromiter((s.pooling is not None for s in seqs), np.bool_, rows)      # embeddings: no logits
    logits_end = np.cumsum(np.where(pool, 0, np.where(all_logits, q_lens, 1)))    # the LM head's rows, per plan row
    prompt_chunks = [chunk for i in np.flatnonzero(prompt).tolist() if (chunk := _prompt_chunk(
        seqs[i], int(logits_end[i] - q_lens[i]), int(starts[i]), int(q_lens[i]))) is not None]
    plan = StepPlan(
        step_id=step_id, kind=kind, input_ids=input_ids, positions=positions, slot_mapping=slots,
        cu_seqlens_q=cu_seqlens_q, context_lens=(starts + q_lens).astype(np.int32), block_tables=block_tables,
        prompt_logits=all_logits if all_logits.any() else None, block_copies=block_copies,
        hidden_rows=pool if pool.any() else None, lora_slot=lora_slots(seqs))
    pool_chunks = [_pool_chunk(seqs[i], int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(starts[i]))
                   for i in np.flatnonzero(pool).tolist()]
    return ScheduledStep(plan, _sampling(seqs, logits_end - 1), prompt_chunks, pool_chunks)


def _pool_chunk(seq: Sequence, first: int, end: int, start: int) -> PoolChunk:
    """The tokens [first, end) of the step (positions start...) that seq's pooling sums: all of them (mean), the
    prompt's first (CLS) or last token (last-token pooling) where this chunk holds it."""
    final = start + end - first == seq.num_tokens
    kind = seq.pooling.kind
    if kind == MEAN:
        rows = np.arange(first, end, dtype=np.int64)
    else:
        wanted = first if kind == CLS else end - 1
        rows = np.array([wanted] if (start == 0 if kind == CLS else final) else [], np.int64)
    return PoolChunk(seq, rows, final)


def _prompt_chunk(seq: Sequence, first_row: int, first_pos: int, count: int) -> PromptChunk | None:
    """Logits row j of a chunk starting at position p predicts the prompt token at p + j + 1; positions already
    recorded (a chunk recomputed after preemption) are left out."""
    have = len(seq.prompt_logprobs)
    targets = np.arange(max(first_pos + 1, have), min(first_pos + count + 1, seq.num_prompt_tokens), dtype=np.int64)
    if not len(targets):
        return None
    chosen = np.fromiter((seq.token_ids[t] for t in targets.tolist()), np.int64, len(targets))
    return PromptChunk(seq, first_row + targets - 1 - first_pos, chosen)


def _sampling(seqs: list[Sequence], last_logits: np.ndarray) -> SamplingBatch:
    """Rows whose prompt is complete after this step sample a token (a middle chunk does not); a prompt with
    unstarted siblings samples theirs from the same logits; an embedding request samples nothing; a row with
    proposed tokens samples at each of its 1 + k positions, as the next k + 1 decode steps would (token index and
    all)."""
    entries, logits_index, index = [], [], []
    for i, seq in enumerate(seqs):
        if seq.pooling is not None or seq.num_cached_tokens + seq.num_scheduled_tokens < seq.num_tokens:
            continue
        k = len(seq.draft)
        for j in range(k + 1):
            for s in (seq, *seq.forks):
                entries.append(s)
                logits_index.append(last_logits[i] - k + j)
                index.append(s.num_completion_tokens + j)
    return SamplingBatch(entries, rows_of(entries), np.asarray(index, np.int64), np.asarray(logits_index, np.int64))
