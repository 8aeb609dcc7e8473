"""Scheduler.adopt, torch-free: a decoding sequence that brings its KV from another engine (engine/kv_transfer.py)
takes blocks (the prefix cache's where the pool holds them), has the others written, enters the prefix cache and
runs; a short pool takes nothing; a failed write gives every block back."""
import pytest

from nanovllm_tp.scheduler import DECODE, Scheduler, SchedulerConfig, Sequence, SequenceStatus

BS = 4


def scheduler(blocks: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(num_kvcache_blocks=blocks, kvcache_block_size=BS, max_model_len=32))


def decoding(seq_id: int, prompt: list[int], out: list[int]) -> Sequence:
    return Sequence(seq_id, prompt, max_tokens=20, ignore_eos=True, output_ids=out)


def test_an_adopted_sequence_runs_and_decodes_its_next_token():
    s = scheduler()
    seq = decoding(0, list(range(1, 10)), [11, 12])          # 11 tokens: the KV of 10 travels, 3 blocks
    written = []
    assert s.adopt(seq, lambda rows, ids: written.append((rows, ids)))
    assert written == [([0, 1, 2], seq.block_table)] and seq.num_cached_tokens == 10
    assert seq.status == SequenceStatus.RUNNING and list(s.running) == [seq]
    step = s.schedule()
    assert step.plan.kind == DECODE and step.plan.input_ids.tolist() == [12]
    assert step.plan.positions.tolist() == [10] and step.plan.context_lens.tolist() == [11]
    s.postprocess([13])
    assert seq.token_ids[-1] == 13 and seq.num_cached_tokens == 11


def test_full_blocks_enter_the_prefix_cache_and_a_held_prefix_is_not_written():
    s = scheduler()
    prompt = list(range(1, 10))
    first = decoding(0, prompt, [11, 12])
    s.adopt(first, lambda rows, ids: None)
    bm = s.block_manager
    assert len(bm.hash_to_block_id) == 2                     # 10 computed tokens: 2 full blocks of 4
    again = decoding(1, prompt, [11, 12])
    written = []
    assert s.adopt(again, lambda rows, ids: written.append(rows))
    assert written == [[2]] and again.block_table[:2] == first.block_table[:2]
    assert bm.num_prefix_hit_tokens == 2 * BS


def test_a_short_pool_takes_nothing_and_a_failed_write_gives_every_block_back():
    s = scheduler(blocks=8)
    long = decoding(0, list(range(1, 30)), [31])               # 29 tokens computed: 8 blocks, the whole pool
    s.adopt(long, lambda rows, ids: None)
    assert s.block_manager.num_free_blocks == 0
    short = decoding(1, [5, 6, 7], [8])
    assert not s.adopt(short, lambda rows, ids: pytest.fail("nothing is written"))
    assert short.block_table == [] and short.status == SequenceStatus.WAITING and list(s.running) == [long]
    s.finish(long, "abort")

    def fail(rows, ids):
        raise OSError("disk on fire")
    with pytest.raises(OSError):
        s.adopt(short, fail)
    assert short.block_table == [] and s.block_manager.num_free_blocks == 8 and not s.running
