"""Pipeline micro-batches (scheduler/micro_batches.py) against the exact fake model of test_scheduler: up to
`count` steps in flight, each plan run when it is published (as every stage runs plans in publish order) and its
results handed back only when it is the oldest, as the last stage's logits reach rank 0. Every output must equal the
reference, no sequence may be in two steps in flight, and KV must never be written into a block that another
sequence reads."""
import collections
import random

import pytest

from nanovllm_tp.scheduler import Sequence, SequenceStatus
from nanovllm_tp.scheduler.micro_batches import MicroBatchScheduler
from nanovllm_tp.scheduler.scheduler import SchedulerConfig
from tests.unit.test_scheduler import EOS, FakeModel, assert_matches_reference


def make(count, num_blocks=12, block_size=4, max_model_len=40, **kw) -> MicroBatchScheduler:
    return MicroBatchScheduler(SchedulerConfig(num_kvcache_blocks=num_blocks, kvcache_block_size=block_size,
                                               max_model_len=max_model_len, eos_token_ids=(EOS,), **kw), count)


def launch(ms: MicroBatchScheduler, model: FakeModel, flight: collections.deque) -> bool:
    """Schedule one step and run it at once; its tokens wait in `flight` for their turn. False when none ran."""
    step = ms.schedule()
    if step is None:
        return False
    rows = ms.rows_in_flight()[-1]
    busy = {id(s) for older in ms.rows_in_flight()[:-1] for s in older}
    assert not busy & {id(s) for s in rows}, "a sequence is in two steps in flight"
    for slot in step.plan.slot_mapping:     # KV is never written into a block another sequence reads
        assert ms.block_manager.blocks[int(slot) // model.bs].ref_count == 1
    tokens = model(step.plan)
    index = {id(s): i for i, s in enumerate(rows)}
    flight.append((step, [tokens[index[id(s)]] for s in step.sampling.seqs]))
    return True


def land(ms: MicroBatchScheduler, flight: collections.deque) -> list[Sequence]:
    step, tokens = flight.popleft()
    assert ms.oldest() is step
    return ms.postprocess(tokens)


@pytest.mark.parametrize("seed,count,num_blocks,prefix_caching", [
    (0, 2, 12, True), (1, 2, 30, True), (2, 3, 14, True), (3, 2, 12, False), (4, 4, 40, True)])
def test_random_workload_equals_the_reference(seed, count, num_blocks, prefix_caching):
    rng = random.Random(seed)
    ms = make(count, num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=10,
              enable_prefix_caching=prefix_caching)
    model = FakeModel(4, eos_every=13)
    prefixes = [[rng.randrange(1, 20) for _ in range(rng.randint(0, 16))] for _ in range(5)]
    seqs = [Sequence(i, (rng.choice(prefixes) + [rng.randrange(1, 20) for _ in range(rng.randint(1, 16))])[:39],
                     max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.2) for i in range(150)]
    pending, flight, step_ids = collections.deque(seqs), collections.deque(), []
    while ms.has_unfinished() or pending or flight:
        while pending and (rng.random() < 0.3 or not ms.has_unfinished()):
            ms.add(pending.popleft())
        while ms.num_in_flight < count and launch(ms, model, flight):
            step_ids.append(flight[-1][0].plan.step_id)
        assert flight, "nothing in flight while sequences are unfinished"
        for s in land(ms, flight):
            assert s.is_finished == (s.status == SequenceStatus.FINISHED)
        assert len(step_ids) < 20_000
    assert step_ids == list(range(1, len(step_ids) + 1))      # one sequence of step ids over every part
    assert ms.max_in_flight == count and ms.schedule() is None
    bm = ms.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert_matches_reference(ms.parts[0], seqs, eos_every=13)
    if prefix_caching:
        assert bm.num_prefix_hit_tokens > 0
    assert ms.num_preemptions > 0 or num_blocks >= 30


def test_requests_spread_over_the_parts_and_each_stays_in_its_part():
    ms = make(2, num_blocks=40)
    seqs = [Sequence(i, [i + 1] * 6, max_tokens=3) for i in range(5)]
    for s in seqs:
        ms.add(s)
    assert [len(p.waiting) for p in ms.parts] == [3, 2]
    model, flight = FakeModel(4), collections.deque()
    assert launch(ms, model, flight) and launch(ms, model, flight)
    assert not launch(ms, model, flight)      # each part has its step in flight: nothing else may start
    first, second = ms.rows_in_flight()
    assert {s.seq_id for s in first} == {0, 2, 4} and {s.seq_id for s in second} == {1, 3}


def test_when_one_part_runs_out_the_other_shares_its_running_sequences():
    # part 0 gets four long requests, part 1 four short ones; once part 1's end, part 0's move over (two each)
    ms = make(2, num_blocks=60)
    seqs = [Sequence(i, [i + 1] * 5, max_tokens=20 if i % 2 == 0 else 2, ignore_eos=True) for i in range(8)]
    for s in seqs:
        ms.add(s)
    model, flight, both = FakeModel(4), collections.deque(), []
    while ms.has_unfinished() or flight:
        while ms.num_in_flight < 2 and launch(ms, model, flight):
            pass
        both.append(ms.num_in_flight)
        land(ms, flight)
    assert ms.num_moved == 2
    assert_matches_reference(ms.parts[0], seqs)
    assert both.count(2) >= 30        # about all of the long requests' 20 steps run as two micro-batches of two


def test_an_abort_during_its_step_waits_for_the_results():
    ms = make(2, num_blocks=40)
    a, b = Sequence(0, [5] * 9, max_tokens=8), Sequence(1, [7] * 9, max_tokens=8)
    ms.add(a)
    ms.add(b)
    model, flight = FakeModel(4), collections.deque()
    launch(ms, model, flight)
    launch(ms, model, flight)
    ms.finish(b, "abort")         # b's step is in flight: its blocks are still being written
    assert not b.is_finished and b.block_table
    assert land(ms, flight) == [a]
    progressed = land(ms, flight)
    assert progressed == [b] and b.finish_reason == "abort" and not b.block_table
    assert len(b.completion_token_ids) == 1       # the token of the step that was in flight is kept
    ms.finish(a, "abort")         # a's part has nothing in flight: at once
    assert a.is_finished and a.finish_reason == "abort" and not ms.has_unfinished()
    assert ms.block_manager.num_free_blocks == 40


def test_a_part_short_of_blocks_waits_for_the_other():
    # 10 blocks of 4: one 36-token sequence fills 9; the second part's prompt cannot start until the first ends
    ms = make(2, num_blocks=10, max_model_len=40)
    long = Sequence(0, list(range(1, 33)), max_tokens=4, ignore_eos=True)
    short = Sequence(1, [3] * 10, max_tokens=2, ignore_eos=True)
    ms.add(long)
    model, flight = FakeModel(4), collections.deque()
    launch(ms, model, flight)
    ms.add(short)
    while ms.has_unfinished():
        while ms.num_in_flight < 2 and launch(ms, model, flight):
            pass
        land(ms, flight)
    assert_matches_reference(ms.parts[0], [long, short])
    assert ms.max_in_flight == 1 and not flight       # no raise, no stall: the second part waited its turn
    assert short.first_token_time > long.finish_time


def test_nothing_in_flight_and_nothing_can_run_is_a_stall():
    ms = make(2, num_blocks=10, max_model_len=40)
    seq = Sequence(0, [1] * 8, max_tokens=2)
    ms.add(seq)
    ms.block_manager.free_block_ids.clear()       # as if every block leaked
    with pytest.raises(RuntimeError, match="scheduler stalled with 1 waiting"):
        ms.schedule()


def test_fewer_than_two_parts_is_refused():
    with pytest.raises(ValueError, match="at least 2"):
        make(1)
