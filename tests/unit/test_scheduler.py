"""Scheduler unit tests: no torch, no model. A fake model stands in for the workers.

`FakeModel` keeps a simulated KV cache. Every slot holds a node of a token trie, i.e. the whole token prefix
that a real key/value at that position depends on. For each row it reads the context back through the row's
block table (checking that every cached position holds the continuation of the one before it, at the right
depth), writes the new tokens at the plan's slots, and emits `next_token(context)`. So a wrong slot, a wrong
block reused from the prefix cache, or stale KV either trips an assertion or changes the generated tokens,
which tests compare with `reference()`, a plain loop over the same next-token function without any cache.
"""
import collections
import math
import random
import subprocess
import sys

import msgpack
import numpy as np
import pytest

from nanovllm_tp.scheduler import DECODE, MIXED, PREFILL, Scheduler, SchedulerConfig, Sequence, SequenceStatus, StepPlan

EOS = 0
VOCAB = 50_000
_MOD = (1 << 61) - 1


def _roll(h: int, token: int) -> int:
    return (h * 1_000_003 + token + 1) % _MOD


def next_token(h: int, eos_every: int = 0) -> int:
    """The fake model's 'argmax': a function of the whole context (through its rolling hash h)."""
    if eos_every and h % eos_every == 0:
        return EOS
    return 1 + h % (VOCAB - 1)


def reference(prompt, max_tokens, max_model_len, eos_every=0, ignore_eos=False):
    """(completion, finish_reason) that an exact engine must produce for this fake model."""
    h = 0
    for t in prompt:
        h = _roll(h, t)
    out, total = [], len(prompt)
    while True:
        t = next_token(h, eos_every)
        out.append(t)
        total += 1
        h = _roll(h, t)
        if t == EOS and not ignore_eos:
            return out, "stop"
        if len(out) >= max_tokens or total >= max_model_len:
            return out, "length"


class FakeModel:
    def __init__(self, block_size: int, eos_every: int = 0):
        self.bs = block_size
        self.eos_every = eos_every
        self.kv: dict[int, int] = {}          # slot -> trie node
        self.parent, self.depth, self.roll = [-1], [0], [0]   # node 0 is the empty prefix
        self.children: dict[tuple[int, int], int] = {}
        self.num_computed_tokens = 0

    def _child(self, node: int, token: int) -> int:
        key = (node, token)
        if key not in self.children:
            self.children[key] = len(self.parent)
            self.parent.append(node)
            self.depth.append(self.depth[node] + 1)
            self.roll.append(_roll(self.roll[node], token))
        return self.children[key]

    def __call__(self, plan: StepPlan) -> list[int]:
        bs, out = self.bs, []
        for r in range(plan.num_rows):
            lo, hi = int(plan.cu_seqlens_q[r]), int(plan.cu_seqlens_q[r + 1])
            table = plan.block_tables[r]
            first = int(plan.positions[lo])
            assert int(plan.context_lens[r]) == first + (hi - lo), "context_lens != cached + new"

            def slot(p):
                assert table[p // bs] >= 0, f"position {p} falls in a padded (-1) block-table entry"
                return int(table[p // bs]) * bs + p % bs

            node = 0
            for p in range(first):             # attention reads every cached position
                cached = self.kv.get(slot(p))
                assert cached is not None, f"row {r} reads never-written KV at position {p}"
                assert self.parent[cached] == node and self.depth[cached] == p + 1, \
                    f"row {r} reads KV of another prefix at position {p} (slot {slot(p)})"
                node = cached
            for j in range(lo, hi):
                p = int(plan.positions[j])
                assert p == first + (j - lo), "positions of a row must be consecutive"
                assert int(plan.slot_mapping[j]) == slot(p), "slot_mapping != block * block_size + offset"
                node = self._child(node, int(plan.input_ids[j]))
                self.kv[slot(p)] = node
            out.append(next_token(self.roll[node], self.eos_every))
        self.num_computed_tokens += plan.num_tokens
        return out


def make_scheduler(num_blocks=16, block_size=4, max_model_len=32, **kw) -> Scheduler:
    kw.setdefault("eos_token_ids", (EOS,))
    return Scheduler(SchedulerConfig(num_kvcache_blocks=num_blocks, kvcache_block_size=block_size,
                                     max_model_len=max_model_len, **kw))


def run(sched: Scheduler, model, on_step=None, max_steps=5_000) -> list[tuple[StepPlan, list[Sequence]]]:
    """Drive sched to completion; returns (plan, rows as sequences) per step."""
    steps = []
    while (step := sched.schedule()) is not None:
        plan = step.plan
        rows = list(sched.scheduled)
        steps.append((plan, rows))
        postprocess(sched, model(plan))
        if on_step is not None:
            on_step(sched, plan, rows)
        assert len(steps) < max_steps, "scheduler does not terminate"
    return steps


def postprocess(sched: Scheduler, row_tokens) -> list[Sequence]:
    """Hand the scheduler the tokens of the rows that sample (row_tokens has one per plan row, as the fake model
    computes them); returns the sequences that finished."""
    index = {id(s): i for i, s in enumerate(sched.scheduled)}
    progressed = sched.postprocess([row_tokens[index[id(s)]] for s in sched.in_flight.sampling.seqs])
    return [s for s in progressed if s.is_finished]


def assert_plan(plan: StepPlan, sched: Scheduler, **expected):
    """Plan fields, and sample_index (per plan row) of the rows that sample this step."""
    if "sample_index" in expected:
        want = expected.pop("sample_index")
        rows = list(sched.scheduled)
        got = [int(i) for i in sched.in_flight.sampling.sample_index]
        assert got == [want[rows.index(s)] for s in sched.in_flight.sampling.seqs], "sample_index"
    for name, value in expected.items():
        got = getattr(plan, name)
        if isinstance(got, np.ndarray):
            np.testing.assert_array_equal(got, np.asarray(value), err_msg=name)
        else:
            assert got == value, name


def assert_all_blocks_free(sched: Scheduler):
    bm = sched.block_manager
    assert [b.ref_count for b in bm.blocks] == [0] * bm.num_blocks
    assert bm.num_free_blocks == bm.num_blocks
    assert not sched.has_unfinished()


def assert_matches_reference(sched: Scheduler, seqs, eos_every=0):
    for s in seqs:
        assert s.is_finished
        want = reference(s.token_ids[:s.num_prompt_tokens], s.max_tokens, sched.config.max_model_len,
                         eos_every, s.ignore_eos)
        assert (s.completion_token_ids, s.finish_reason) == want, f"sequence {s.seq_id}"


# ---------------------------------------------------------------- exact plans

def test_prefill_then_decode_plans_are_exact():
    # block_size 4, blocks handed out in id order: A (6 tokens) gets blocks 0,1; B (3 tokens) gets block 2.
    sched = make_scheduler()
    a, b = Sequence(0, [10, 11, 12, 13, 14, 15]), Sequence(1, [20, 21, 22])
    sched.add(a)
    sched.add(b)
    plan = sched.schedule().plan
    assert_plan(plan, sched, kind=PREFILL, step_id=1,
                input_ids=[10, 11, 12, 13, 14, 15, 20, 21, 22],
                positions=[0, 1, 2, 3, 4, 5, 0, 1, 2],
                slot_mapping=[0, 1, 2, 3, 4, 5, 8, 9, 10],      # block*4+offset
                cu_seqlens_q=[0, 6, 9], context_lens=[6, 3],
                block_tables=[[0, 1], [2, -1]], sample_index=[0, 0])
    assert plan.input_ids.dtype == np.int64 and plan.cu_seqlens_q.dtype == np.int32
    assert plan.block_tables.dtype == np.int32 and plan.slot_mapping.dtype == np.int64
    assert postprocess(sched, [100, 200]) == []

    # Decode: one row per sequence, the last sampled token at position len-1.
    plan = sched.schedule().plan
    assert_plan(plan, sched, kind=DECODE, step_id=2, input_ids=[100, 200], positions=[6, 3],
                slot_mapping=[1 * 4 + 2, 2 * 4 + 3], cu_seqlens_q=[0, 1, 2], context_lens=[7, 4],
                block_tables=[[0, 1], [2, -1]], sample_index=[1, 1])
    postprocess(sched, [101, 201])

    # B's next token (position 4) crosses into a new block: the next free one, 3.
    plan = sched.schedule().plan
    assert_plan(plan, sched, kind=DECODE, input_ids=[101, 201], positions=[7, 4], slot_mapping=[7, 12],
                context_lens=[8, 5], block_tables=[[0, 1], [2, 3]], sample_index=[2, 2])
    postprocess(sched, [102, 202])
    assert a.completion_token_ids == [100, 101, 102] and b.completion_token_ids == [200, 201, 202]


def test_chunked_prefill_plans_and_middle_chunk_samples_are_dropped():
    # Token budget 4: A (10 tokens, blocks 0,1,2 allocated up front) runs as chunks 4+4+2; the last chunk
    # leaves 2 tokens of budget, exactly B's prompt, so B (block 3) joins that step.
    sched = make_scheduler(max_num_batched_tokens=4)
    a, b = Sequence(0, list(range(30, 40))), Sequence(1, [50, 51])
    sched.add(a)
    sched.add(b)

    plan = sched.schedule().plan
    assert_plan(plan, sched, kind=PREFILL, input_ids=[30, 31, 32, 33], positions=[0, 1, 2, 3], slot_mapping=[0, 1, 2, 3],
                cu_seqlens_q=[0, 4], context_lens=[4], block_tables=[[0, 1, 2]], sample_index=[0])
    assert postprocess(sched, [777]) == []
    assert a.num_tokens == 10 and a.num_cached_tokens == 4          # the middle-chunk sample is dropped
    assert list(sched.waiting) == [a, b] and a.status == SequenceStatus.WAITING

    plan = sched.schedule().plan
    assert_plan(plan, sched, input_ids=[34, 35, 36, 37], positions=[4, 5, 6, 7], slot_mapping=[4, 5, 6, 7],
                cu_seqlens_q=[0, 4], context_lens=[8], block_tables=[[0, 1, 2]], sample_index=[0])
    postprocess(sched, [778])
    assert a.num_tokens == 10

    plan = sched.schedule().plan
    assert_plan(plan, sched, kind=PREFILL, input_ids=[38, 39, 50, 51], positions=[8, 9, 0, 1], slot_mapping=[8, 9, 12, 13],
                cu_seqlens_q=[0, 2, 4], context_lens=[10, 2], block_tables=[[0, 1, 2], [3, -1, -1]],
                sample_index=[0, 0])
    postprocess(sched, [5, 6])
    assert a.completion_token_ids == [5] and b.completion_token_ids == [6]
    assert list(sched.running) == [a, b] and not sched.waiting


def test_only_the_first_sequence_of_a_step_is_chunked():
    # Budget 8: A (6) fits, B (5) would need chunking behind A, so the step stops there; C (1 token) would
    # fit the 2 left over but may not jump B (strict FCFS). Next step A decodes and B and C run whole.
    sched = make_scheduler(max_num_batched_tokens=8)
    a, b, c = Sequence(0, [1] * 6), Sequence(1, [2] * 5), Sequence(2, [3])
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule().plan
    assert plan.num_tokens == 6 and list(sched.scheduled) == [a]
    postprocess(sched, [9])
    plan = sched.schedule().plan
    assert plan.kind == MIXED and list(sched.scheduled) == [a, b, c]
    np.testing.assert_array_equal(plan.cu_seqlens_q, [0, 1, 6, 7])


def test_chunked_sequence_continues_with_prefix_cache_and_gives_exact_tokens():
    # Long prompts under a small budget with a shared prefix: chunks, cache hits and decode all mixed.
    model, sched = FakeModel(4), make_scheduler(num_blocks=20, max_model_len=64, max_num_batched_tokens=6)
    base = list(range(100, 118))
    seqs = [Sequence(i, base[:10 + i] + [i], max_tokens=5) for i in range(4)]
    for s in seqs:
        sched.add(s)
    steps = run(sched, model)
    assert all(p.num_tokens <= 6 for p, _ in steps)
    assert any(rows[0].num_cached_tokens < rows[0].num_tokens for p, rows in steps if p.is_prefill)
    assert sched.block_manager.num_prefix_hit_tokens > 0
    assert_matches_reference(sched, seqs)
    assert_all_blocks_free(sched)


def test_prefix_hit_plan_is_exact_and_shared_blocks_are_ref_counted():
    # A = 1..9 fills blocks 0,1 and part of 2; once its prefill has run, B = 1..8,50,51 hits blocks 0,1 and
    # computes only its last 2 tokens, in the next free block (3), in a mixed step behind A's decode row.
    model, sched = FakeModel(4), make_scheduler()
    bm = sched.block_manager
    a = Sequence(0, list(range(1, 10)), max_tokens=3)
    sched.add(a)
    postprocess(sched, model(sched.schedule().plan))
    b = Sequence(1, list(range(1, 9)) + [50, 51], max_tokens=3)
    sched.add(b)
    plan = sched.schedule().plan
    assert_plan(plan, sched, kind=MIXED, input_ids=[a.token_ids[9], 50, 51], positions=[9, 8, 9], slot_mapping=[9, 12, 13],
                cu_seqlens_q=[0, 1, 3], context_lens=[10, 10], block_tables=[[0, 1, 2], [0, 1, 3]],
                sample_index=[1, 0])
    assert b.num_cached_tokens == 8 and bm.num_prefix_hit_tokens == 8
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert bm.num_free_blocks == bm.num_blocks - 4
    postprocess(sched, model(plan))
    run(sched, model)
    assert_matches_reference(sched, [a, b])
    assert_all_blocks_free(sched)


def test_block_aligned_prompt_fully_cached_still_computes_a_token():
    # An 8-token prompt (2 full blocks) run twice. The second time every block is cached, yet the engine
    # needs the last token's logits: the last block is recomputed (into a fresh block), only block 0 is hit.
    model, sched = FakeModel(4), make_scheduler()
    prompt = [7, 8, 9, 10, 11, 12, 13, 14]
    first = Sequence(0, prompt, max_tokens=2)
    sched.add(first)
    run(sched, model)
    again = Sequence(1, prompt, max_tokens=2)
    sched.add(again)
    plan = sched.schedule().plan
    assert plan.num_tokens >= 1
    assert_plan(plan, sched, input_ids=prompt[4:], positions=[4, 5, 6, 7], context_lens=[8])
    assert again.num_cached_tokens == 4 and again.block_table[0] == first_block(sched, prompt)
    postprocess(sched, model(plan))
    run(sched, model)
    assert again.completion_token_ids == first.completion_token_ids
    assert_all_blocks_free(sched)


def first_block(sched, prompt):
    bm = sched.block_manager
    return bm.hash_to_block_id[bm.chain_hash(None, tuple(prompt[:sched.block_size]))]


def test_prompt_of_one_block_plus_one_token_hits_and_computes_one_token():
    model, sched = FakeModel(4), make_scheduler()
    prompt = [3, 1, 4, 1, 5]
    sched.add(Sequence(0, prompt, max_tokens=1))
    run(sched, model)
    s = Sequence(1, prompt, max_tokens=1)
    sched.add(s)
    plan = sched.schedule().plan
    assert_plan(plan, sched, input_ids=[5], positions=[4], context_lens=[5])
    postprocess(sched, model(plan))
    assert_matches_reference(sched, [s])


# ---------------------------------------------------------------- budgets and order

@pytest.mark.parametrize("max_num_seqs,max_num_batched_tokens", [(1, 64), (2, 7), (3, 5), (4, 64)])
def test_per_step_limits(max_num_seqs, max_num_batched_tokens):
    model = FakeModel(4)
    sched = make_scheduler(num_blocks=40, max_model_len=24, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens)
    rng = random.Random(max_num_seqs)
    seqs = [Sequence(i, [rng.randrange(1, 99) for _ in range(rng.randint(1, 12))], max_tokens=rng.randint(1, 6))
            for i in range(9)]
    for s in seqs:
        sched.add(s)
    steps = run(sched, model)
    for plan, rows in steps:
        assert plan.num_rows <= max_num_seqs
        assert plan.num_tokens <= max_num_batched_tokens
        assert len(set(map(id, rows))) == len(rows)
    assert max(p.num_rows for p, _ in steps) == max_num_seqs   # the limit is reached, not just respected
    assert_matches_reference(sched, seqs)
    assert_all_blocks_free(sched)


def test_decode_respects_token_budget():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=2)
    for i in range(4):
        sched.add(Sequence(i, [i + 1], max_tokens=4))
    model = FakeModel(4)
    for plan, _ in run(sched, model):
        assert plan.num_tokens <= 2, f"{'prefill' if plan.is_prefill else 'decode'} step of {plan.num_tokens}"


def test_fcfs_head_that_does_not_fit_blocks_those_behind_it():
    # 4 blocks of 4. A (12 tokens) holds 3 blocks; B needs 2 (only 1 free), C would fit in the free one,
    # but nothing jumps B: the step decodes A instead.
    model, sched = FakeModel(4), make_scheduler(num_blocks=4, max_model_len=16)
    a = Sequence(0, list(range(1, 13)), max_tokens=3)
    b, c = Sequence(1, list(range(20, 28)), max_tokens=2), Sequence(2, [40], max_tokens=2)
    sched.add(a)
    postprocess(sched, model(sched.schedule().plan))
    sched.add(b)
    sched.add(c)
    plan = sched.schedule().plan
    assert plan.kind == DECODE and list(sched.scheduled) == [a]
    assert list(sched.waiting) == [b, c] and not b.block_table and not c.block_table
    postprocess(sched, model(plan))
    order = [rows for p, rows in run(sched, model) if p.is_prefill]
    assert order[0][0] is b   # B is prefilled before C
    assert_matches_reference(sched, [a, b, c])


# ---------------------------------------------------------------- mixed steps

def test_new_prompt_joins_running_decodes_in_a_mixed_step():
    # A (6 tokens) is decoding when B (5 tokens) arrives: the next step computes A's next token and B's whole
    # prompt together. A's row comes first: one token at position 6 over its 6 cached, in its block 1.
    model, sched = FakeModel(4), make_scheduler()
    a = Sequence(0, [1, 2, 3, 4, 5, 6], max_tokens=5, ignore_eos=True)
    b = Sequence(1, [7, 8, 9, 10, 11], max_tokens=4, ignore_eos=True)
    sched.add(a)
    postprocess(sched, model(sched.schedule().plan))          # A's prefill: blocks 0, 1
    plan = sched.schedule().plan
    assert plan.kind == DECODE
    postprocess(sched, model(plan))                      # A has 8 tokens, 7 computed
    sched.add(b)
    plan = sched.schedule().plan
    assert list(sched.scheduled) == [a, b]
    assert_plan(plan, sched, kind=MIXED, input_ids=[a.token_ids[7], 7, 8, 9, 10, 11], positions=[7, 0, 1, 2, 3, 4],
                slot_mapping=[7, 8, 9, 10, 11, 12], cu_seqlens_q=[0, 1, 6], context_lens=[8, 5],
                block_tables=[[0, 1], [2, 3]], sample_index=[2, 0])
    assert plan.is_prefill, "mixed steps take the varlen path on the workers"
    postprocess(sched, model(plan))
    assert a.num_completion_tokens == 3 and b.num_completion_tokens == 1
    run(sched, model)
    assert_matches_reference(sched, [a, b])
    assert_all_blocks_free(sched)


def test_mixed_step_decode_rows_take_their_share_of_the_budgets():
    # 3 decoding rows leave 7 of the 10-token budget (a chunk of D's 12-token prompt) and 1 of the 4 rows.
    model, sched = FakeModel(4), make_scheduler(num_blocks=32, max_num_seqs=4, max_num_batched_tokens=10)
    running = [Sequence(i, [10 * i + 1, 10 * i + 2], max_tokens=20, ignore_eos=True) for i in range(3)]
    for s in running:
        sched.add(s)
    postprocess(sched, model(sched.schedule().plan))
    d, e = Sequence(3, list(range(40, 52)), max_tokens=2), Sequence(4, [60], max_tokens=2)
    sched.add(d)
    sched.add(e)
    plan = sched.schedule().plan
    assert plan.kind == MIXED and list(sched.scheduled) == running + [d]
    assert np.diff(plan.cu_seqlens_q).tolist() == [1, 1, 1, 7] and plan.num_tokens == 10
    postprocess(sched, model(plan))
    assert d.num_cached_tokens == 7 and not d.completion_token_ids, "a middle chunk samples nothing"
    assert list(sched.waiting) == [d, e]
    run(sched, model)
    assert_matches_reference(sched, running + [d, e])
    assert_all_blocks_free(sched)


def test_full_batch_keeps_the_decode_fast_path():
    # max_num_seqs rows are running: a new prompt waits, and the step is a plain decode step.
    model, sched = FakeModel(4), make_scheduler(max_num_seqs=2)
    a, b = Sequence(0, [1, 2], max_tokens=4), Sequence(1, [3, 4], max_tokens=4)
    sched.add(a)
    sched.add(b)
    postprocess(sched, model(sched.schedule().plan))
    c = Sequence(2, [5, 6], max_tokens=2)
    sched.add(c)
    plan = sched.schedule().plan
    assert plan.kind == DECODE and list(sched.scheduled) == [a, b] and list(sched.waiting) == [c]
    postprocess(sched, model(plan))
    run(sched, model)
    assert_matches_reference(sched, [a, b, c])


# ---------------------------------------------------------------- preemption

def test_decode_preempts_the_tail_first_and_it_completes_by_recompute():
    # 4 blocks of 4; A, B, C, D (4 tokens each) hold blocks 0..3 and each samples one token, so each needs a
    # new block for position 4 and none is free. A preempts the tail of running, D (block 3 -> A); B then
    # preempts C (block 2 -> B). Preempted sequences go back to the head of waiting in their original order.
    model, sched = FakeModel(4), make_scheduler(num_blocks=4, max_model_len=16)
    a, b, c, d = seqs = [Sequence(i, [10 * i + k for k in range(1, 5)], max_tokens=6, ignore_eos=True)
                         for i in range(4)]
    for s in seqs:
        sched.add(s)
    postprocess(sched, model(sched.schedule().plan))
    plan = sched.schedule().plan
    assert plan.kind == DECODE and list(sched.scheduled) == [a, b]
    assert_plan(plan, sched, positions=[4, 4], slot_mapping=[3 * 4, 2 * 4], block_tables=[[0, 3], [1, 2]])
    assert sched.num_preemptions == 2
    assert list(sched.waiting) == [c, d] and list(sched.running) == [a, b]
    for s in (c, d):
        assert s.status == SequenceStatus.WAITING
        assert s.block_table == [] and s.num_cached_tokens == 0 and s.num_tokens == 5
    generated_before = c.completion_token_ids
    postprocess(sched, model(plan))

    steps = run(sched, model)
    # C comes back as a prefill of prompt + the token it had sampled (its cached block was evicted by B).
    redo, rows = next((p, rows) for p, rows in steps if c in rows)
    r = rows.index(c)
    lo, hi = redo.cu_seqlens_q[r], redo.cu_seqlens_q[r + 1]
    assert redo.is_prefill
    assert redo.input_ids[lo:hi].tolist() == c.token_ids[:5] and redo.positions[lo:hi].tolist() == [0, 1, 2, 3, 4]
    assert c.completion_token_ids[:1] == generated_before
    assert_matches_reference(sched, seqs)
    assert_all_blocks_free(sched)


def test_decode_preempts_itself_when_alone():
    # A (4 tokens) has block 0, B (8 tokens) blocks 1,2; free: [3]. C (8 tokens) arrives and cannot be
    # allocated, so the step decodes: A takes block 3 for position 4; B needs a block for position 8, running
    # is empty by then, so B preempts itself, ahead of C in waiting. The step decodes A alone.
    model, sched = FakeModel(4), make_scheduler(num_blocks=4, max_model_len=16)
    a = Sequence(0, [1, 2, 3, 4], max_tokens=3)
    b = Sequence(1, list(range(11, 19)), max_tokens=3)
    c = Sequence(2, list(range(21, 29)), max_tokens=3)
    sched.add(a)
    sched.add(b)
    postprocess(sched, model(sched.schedule().plan))
    sched.add(c)
    plan = sched.schedule().plan
    assert plan.kind == DECODE and list(sched.scheduled) == [a] and list(sched.waiting) == [b, c]
    assert b.block_table == [] and sched.num_preemptions == 1
    postprocess(sched, model(plan))
    run(sched, model)
    assert_matches_reference(sched, [a, b, c])
    assert_all_blocks_free(sched)


def test_preempted_sequence_re_hits_its_freed_blocks():
    # 4 blocks of 4. A (4 tokens) holds block 0, B (9 tokens) blocks 1,2,3. After prefill A needs a block and
    # preempts B: B's blocks go back tail-first (3, 2, 1), A takes 3, the hashed full blocks 1 and 2 survive.
    # B cannot come back until A finishes (it needs 3 blocks, 2 free); then it re-hits blocks 1,2 and
    # computes only positions 8 (its last prompt token) and 9 (its sampled token) in block 3.
    model, sched = FakeModel(4), make_scheduler(num_blocks=4, max_model_len=16)
    bm = sched.block_manager
    a = Sequence(0, [1, 2, 3, 4], max_tokens=3)
    b = Sequence(1, list(range(11, 20)), max_tokens=4)
    sched.add(a)
    sched.add(b)
    postprocess(sched, model(sched.schedule().plan))
    postprocess(sched, model(sched.schedule().plan))        # A decodes, B preempted
    assert list(sched.waiting) == [b] and sched.num_preemptions == 1
    assert bm.blocks[1].hash is not None and bm.blocks[2].hash is not None   # kept while free
    plan = sched.schedule().plan                            # B does not fit yet: A decodes and finishes
    assert plan.kind == DECODE and list(sched.scheduled) == [a]
    assert [s.seq_id for s in postprocess(sched, model(plan))] == [0]

    plan = sched.schedule().plan
    assert list(sched.scheduled) == [b]
    assert_plan(plan, sched, kind=PREFILL, input_ids=[19, b.token_ids[9]], positions=[8, 9], slot_mapping=[12, 13],
                context_lens=[10], block_tables=[[1, 2, 3]], sample_index=[1])
    assert bm.num_prefix_hit_tokens == 8
    postprocess(sched, model(plan))
    run(sched, model)
    assert_matches_reference(sched, [a, b])
    assert_all_blocks_free(sched)


def test_later_identical_prompt_hits_freed_blocks():
    model, sched = FakeModel(4), make_scheduler()
    bm = sched.block_manager
    prompt = list(range(60, 70))    # 10 tokens: 2 full blocks + 2
    first = Sequence(0, prompt, max_tokens=3)
    sched.add(first)
    run(sched, model)
    assert_all_blocks_free(sched)
    computed = model.num_computed_tokens
    second = Sequence(1, prompt, max_tokens=3)
    sched.add(second)
    plan = sched.schedule().plan
    assert plan.num_tokens == 2 and second.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in second.block_table[:2]] == [1, 1]
    postprocess(sched, model(plan))
    run(sched, model)
    assert model.num_computed_tokens - computed == 2 + 2    # 2 prompt tokens + 2 decode steps
    assert second.completion_token_ids == first.completion_token_ids
    assert_all_blocks_free(sched)


def test_prefix_caching_disabled_never_hits():
    model, sched = FakeModel(4), make_scheduler(enable_prefix_caching=False)
    prompt = list(range(60, 70))
    seqs = [Sequence(i, prompt, max_tokens=2) for i in range(2)]
    sched.add(seqs[0])
    run(sched, model)
    sched.add(seqs[1])
    assert sched.schedule().plan.num_tokens == 10
    assert sched.block_manager.num_prefix_hit_tokens == 0 and not sched.block_manager.hash_to_block_id


# ---------------------------------------------------------------- finishing

def constant(token):
    return lambda plan: [token] * plan.num_rows


@pytest.mark.parametrize("token,ignore_eos,max_tokens,want_len,want_reason", [
    (EOS, False, 5, 1, "stop"),       # EOS ends at once
    (EOS, False, 1, 1, "stop"),       # EOS on the last allowed token still says stop
    (EOS, True, 5, 5, "length"),      # ignore_eos runs through EOS up to max_tokens
    (7, False, 5, 5, "length"),
    (7, False, 1, 1, "length"),
])
def test_finish_reasons(token, ignore_eos, max_tokens, want_len, want_reason):
    sched = make_scheduler()
    s = Sequence(0, [1, 2, 3], max_tokens=max_tokens, ignore_eos=ignore_eos)
    sched.add(s)
    steps = run(sched, constant(token))
    assert s.completion_token_ids == [token] * want_len and s.finish_reason == want_reason
    assert len(steps) == want_len
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("prompt_len,want_len", [(31, 1), (30, 2), (29, 3)])
def test_max_model_len_caps_output(prompt_len, want_len):
    sched = make_scheduler(max_model_len=32)
    s = Sequence(0, [5] * prompt_len, max_tokens=100, ignore_eos=True)
    sched.add(s)
    run(sched, constant(EOS))
    assert len(s.completion_token_ids) == want_len and s.finish_reason == "length" and s.num_tokens == 32


def test_eos_ids_are_the_configured_ones():
    sched = make_scheduler(eos_token_ids=(3, 4))
    a, b, c = Sequence(0, [1], max_tokens=4), Sequence(1, [1], max_tokens=4), Sequence(2, [1], max_tokens=4)
    for s in (a, b, c):
        sched.add(s)
    postprocess(sched, constant(9)(sched.schedule().plan))
    sched.schedule().plan
    finished = postprocess(sched, [3, 4, EOS])   # EOS=0 is not an eos id of this scheduler
    assert finished == [a, b] and a.finish_reason == b.finish_reason == "stop" and not c.is_finished


# ---------------------------------------------------------------- StepPlan wire format

def _plans_of_every_kind():
    model, sched = FakeModel(4), make_scheduler(max_num_batched_tokens=6)
    sched.add(Sequence(0, list(range(1, 10)), max_tokens=3, temperature=0.7, seed=2**63 - 1))
    sched.add(Sequence(1, list(range(1, 9)) + [42], max_tokens=3))
    return [p for p, _ in run(sched, model)]


def test_step_plan_round_trip_is_exact():
    plans = _plans_of_every_kind()
    assert {p.kind for p in plans} == {PREFILL, DECODE, MIXED}
    for plan in plans:
        back = StepPlan.decode(plan.encode())
        for name in StepPlan.__dataclass_fields__:
            want, got = getattr(plan, name), getattr(back, name)
            if isinstance(want, np.ndarray):
                assert got.dtype == want.dtype and got.shape == want.shape, name
                np.testing.assert_array_equal(got, want, err_msg=name)
            else:
                assert type(got) is type(want) and got == want, name


def test_step_plan_bytes_are_plain_msgpack():
    plan = _plans_of_every_kind()[0]

    def walk(x):
        assert isinstance(x, (dict, list, str, bytes, int, float, bool, type(None))), type(x)
        for v in (x.values() if isinstance(x, dict) else x if isinstance(x, list) else ()):
            walk(v)

    raw = msgpack.unpackb(plan.encode(), raw=False, strict_map_key=True,
                          ext_hook=lambda code, data: pytest.fail(f"msgpack ext type {code} in a StepPlan"))
    walk(raw)
    assert set(raw) == set(StepPlan.__dataclass_fields__)
    dtype, shape, buf = raw["block_tables"]
    assert np.dtype(dtype) == np.int32 and shape == list(plan.block_tables.shape)
    assert buf == plan.block_tables.tobytes()


# ---------------------------------------------------------------- configuration and input errors

def test_config_where_one_max_len_sequence_cannot_fit_is_refused():
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(num_blocks=7, block_size=4, max_model_len=29)    # needs ceil(29/4) = 8 blocks
    make_scheduler(num_blocks=8, block_size=4, max_model_len=29)


@pytest.mark.parametrize("num_tokens", [0, 16, 17])
def test_adding_a_sequence_of_bad_length_is_refused(num_tokens):
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len=16"):
        sched.add(Sequence(0, [1] * num_tokens))
    assert not sched.has_unfinished()
    sched.add(Sequence(1, [1] * 15))           # 15 = max_model_len - 1 is the longest allowed


def test_schedule_and_postprocess_must_alternate():
    sched = make_scheduler()
    sched.add(Sequence(0, [1, 2]))
    sched.schedule().plan
    with pytest.raises(RuntimeError):
        sched.schedule().plan
    with pytest.raises(RuntimeError, match="2 sampled tokens for 1 sampling rows"):
        sched.postprocess([1, 2])


def test_abort_all_frees_everything():
    model, sched = FakeModel(4), make_scheduler(max_num_batched_tokens=4)
    seqs = [Sequence(i, list(range(1, 11)), max_tokens=5) for i in range(3)]
    for s in seqs:
        sched.add(s)
    postprocess(sched, model(sched.schedule().plan))     # one chunk of seq 0
    sched.schedule().plan                               # a step in flight
    dropped = sched.abort_all()
    assert sorted(s.seq_id for s in dropped) == [0, 1, 2]
    assert all(s.finish_reason == "abort" for s in seqs)
    assert_all_blocks_free(sched)
    assert sched.schedule() is None


@pytest.mark.spawn
def test_scheduler_import_does_not_pull_in_torch():
    code = ("import sys, nanovllm_tp.scheduler, nanovllm_tp.sampling_params; "
            "sys.exit(3 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---------------------------------------------------------------- randomized stress

def check_invariants(sched: Scheduler):
    bm, bs = sched.block_manager, sched.block_size
    live = list(sched.waiting) + list(sched.running)
    assert len({s.seq_id for s in live}) == len(live), "a sequence is queued twice"
    owners = collections.defaultdict(list)
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table), f"{s} holds a block twice"
        for i, b in enumerate(s.block_table):
            owners[b].append((s, i))
    for block in bm.blocks:
        own = owners.get(block.block_id, [])
        assert block.ref_count == len(own), f"block {block.block_id}: ref_count {block.ref_count}, owners {own}"
        if len(own) > 1:     # only a cached, fully computed prefix block may be shared, at the same index
            assert block.hash is not None and len({i for _, i in own}) == 1
            for s, i in own:
                assert (i + 1) * bs <= s.num_cached_tokens and s.block_tokens(i, bs) == block.token_ids
    free = set(bm.free_ids())
    assert free == {b.block_id for b in bm.blocks if b.ref_count == 0}
    assert len(free) + len(owners) == bm.num_blocks
    for h, b in bm.hash_to_block_id.items():
        assert bm.blocks[b].hash == h
    for s in list(sched.waiting)[1:]:
        assert not s.block_table and s.num_cached_tokens == 0, "only the head of waiting may be mid-prefill"
    for s in sched.running:
        assert s.status == SequenceStatus.RUNNING
        assert math.ceil(s.num_cached_tokens / bs) <= len(s.block_table) <= math.ceil(s.num_tokens / bs)


@pytest.mark.parametrize("seed,block_size,num_blocks,prefix_caching", [
    (0, 4, 10, True), (1, 4, 12, False), (2, 1, 40, True), (3, 8, 5, True), (4, 4, 10, True), (5, 2, 20, True)])
def test_random_stress(seed, block_size, num_blocks, prefix_caching):
    rng = random.Random(seed)
    max_model_len, max_num_seqs, budget, eos_every = 40, 5, 12, 13
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                           enable_prefix_caching=prefix_caching)
    model = FakeModel(block_size, eos_every=eos_every)
    prefixes = [[rng.randrange(1, 20) for _ in range(rng.randint(0, 16))] for _ in range(6)]

    def new_request(i):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 20) for _ in range(rng.randint(1, 20))]
        return Sequence(i, prompt[:max_model_len - 1], max_tokens=rng.randint(1, 24),
                        ignore_eos=rng.random() < 0.2)

    seqs = [new_request(i) for i in range(300)]
    pending = collections.deque(seqs)
    for _ in range(20):
        sched.add(pending.popleft())
    bm, num_steps = sched.block_manager, 0
    while sched.has_unfinished() or pending:
        while pending and rng.random() < 0.3:
            sched.add(pending.popleft())
        was_running = {id(s) for s in sched.running}
        plan = sched.schedule().plan
        rows = list(sched.scheduled)
        assert plan is not None
        check_invariants(sched)
        assert plan.num_rows == len(rows) <= max_num_seqs and plan.num_tokens <= budget
        assert len(set(map(id, rows))) == len(rows)
        if plan.is_prefill:    # at most one row is a partial prompt chunk; mixed steps list decode rows first
            assert sum(s.num_cached_tokens + s.num_scheduled_tokens != s.num_tokens for s in rows) <= 1
            decodes = [id(s) in was_running for s in rows]
            assert (plan.kind == MIXED) == decodes[0] and decodes == sorted(decodes, reverse=True)
            assert all(q == 1 for q, d in zip(np.diff(plan.cu_seqlens_q), decodes) if d)
        else:
            assert plan.num_tokens == plan.num_rows
        for slot in plan.slot_mapping:    # KV is never written into a block another sequence reads
            assert bm.blocks[int(slot) // block_size].ref_count == 1
        finished = postprocess(sched, model(plan))
        assert all(s.is_finished and not s.block_table for s in finished)
        check_invariants(sched)
        for s in finished:     # a follow-up: prompt + completion + more, over blocks that decode steps filled
            if rng.random() < 0.25 and s.num_tokens < max_model_len - 2:
                seqs.append(Sequence(len(seqs), s.token_ids + [rng.randrange(1, 20)], max_tokens=rng.randint(1, 8),
                                     ignore_eos=True))
                pending.append(seqs[-1])
        num_steps += 1
        assert num_steps < 50_000
    assert sched.schedule() is None
    assert_all_blocks_free(sched)
    assert_matches_reference(sched, seqs, eos_every)
    for s in seqs:
        out = s.completion_token_ids
        assert 1 <= len(out) <= s.max_tokens and s.num_tokens <= max_model_len
        if not s.ignore_eos:
            assert EOS not in out[:-1]
        assert (s.finish_reason == "stop") == (out[-1] == EOS and not s.ignore_eos)
        if s.finish_reason == "length":
            assert len(out) == s.max_tokens or s.num_tokens == max_model_len
    if prefix_caching:
        assert bm.num_prefix_hit_tokens > 0
    assert sched.num_preemptions > 0 or num_blocks * block_size >= 200


def _plan_stream(seed: int, rebuild_every_decode: bool, monkeypatch) -> tuple[list[bytes], list[list[int]]]:
    """Every plan's bytes and every output, for a seeded workload with arrivals, EOS and preemptions."""
    if rebuild_every_decode:     # never reuse the decode batch: the plain path the fast one must equal
        monkeypatch.setattr(Scheduler, "_grow", lambda self, batch: False)
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=14, block_size=4, max_model_len=48, max_num_seqs=6, max_num_batched_tokens=16)
    model = FakeModel(4, eos_every=11)
    seqs = [Sequence(i, [rng.randrange(1, 20) for _ in range(rng.randint(1, 18))], max_tokens=rng.randint(1, 30),
                     ignore_eos=rng.random() < 0.3) for i in range(120)]
    pending, plans = collections.deque(seqs), []
    while sched.has_unfinished() or pending:
        while pending and rng.random() < 0.2:
            sched.add(pending.popleft())
        if not sched.has_unfinished():
            sched.add(pending.popleft())
        plan = sched.schedule().plan
        plans.append(plan.encode())
        postprocess(sched, model(plan))
    monkeypatch.undo()
    return plans, [s.completion_token_ids for s in seqs]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_batch_fast_path_equals_rebuilding_every_step(seed, monkeypatch):
    fast_plans, fast_out = _plan_stream(seed, False, monkeypatch)
    slow_plans, slow_out = _plan_stream(seed, True, monkeypatch)
    assert fast_out == slow_out
    assert fast_plans == slow_plans


@pytest.mark.parametrize("block_size", [2, 4])
def test_follow_up_reuses_decode_filled_blocks_only_once_computed(block_size):
    # The last sampled token completes a block but is never computed (the request ends there): that block may
    # not be a prefix-cache hit for the follow-up, the blocks before it (filled by decode steps) must be.
    prompt = [3, 1, 4, 1, 5]
    max_tokens = 3 * block_size - len(prompt) % block_size
    sched, model = make_scheduler(num_blocks=16, block_size=block_size), FakeModel(block_size)
    first = Sequence(0, prompt, max_tokens=max_tokens, ignore_eos=True)
    sched.add(first)
    run(sched, model)
    assert first.num_tokens % block_size == 0
    follow = Sequence(1, first.token_ids + [9], max_tokens=4, ignore_eos=True)
    sched.add(follow)
    run(sched, model)
    assert follow.block_table == [] and follow.is_finished
    assert_matches_reference(sched, [first, follow])
    hits = sched.block_manager.num_prefix_hit_tokens
    assert hits == first.num_tokens - block_size       # everything but the never-computed last block
