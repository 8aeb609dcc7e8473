"""BlockManager unit tests: ref counts, the free list, the prefix cache (hash chain + token verification).

Most tests drive the BlockManager directly; `prefill()` plays the part of a scheduler step that computes a
sequence's whole prompt. The collision tests also run the Scheduler with a small KV-checking fake model, so
that reusing the wrong block shows up as wrong KV, not just as a different block id.
"""
import pytest

from nanovllm_tp.scheduler import BlockManager, Scheduler, SchedulerConfig, Sequence

BS = 4


def prefill(bm: BlockManager, seq: Sequence) -> list[int]:
    """Allocate seq (taking any cache hits) and mark its prompt computed, as one prefill step would."""
    hits = bm.can_allocate(seq)
    assert hits is not None, "no room"
    bm.allocate(seq, hits)
    seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens
    seq.num_cached_tokens = seq.num_tokens
    bm.hash_blocks(seq)
    seq.num_scheduled_tokens = 0
    return hits


def ref_counts(bm):
    return [b.ref_count for b in bm.blocks]


def test_constructor_refuses_empty_pool():
    with pytest.raises(ValueError):
        BlockManager(0, BS)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_allocate_and_deallocate_count_blocks():
    bm = BlockManager(8, BS)
    a, b = Sequence(0, list(range(1, 10))), Sequence(1, [50, 51])    # 3 blocks, 1 block
    prefill(bm, a)
    prefill(bm, b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3]
    assert ref_counts(bm) == [1, 1, 1, 1, 0, 0, 0, 0] and bm.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        bm.allocate(a, [])                      # already holds blocks
    bm.deallocate(a)
    assert a.block_table == [] and a.num_cached_tokens == 0
    assert ref_counts(bm) == [0, 0, 0, 1, 0, 0, 0, 0] and bm.num_free_blocks == 7
    bm.deallocate(b)
    assert bm.num_free_blocks == 8


def test_only_full_computed_blocks_are_hashed():
    bm = BlockManager(8, BS)
    a = Sequence(0, list(range(1, 11)))         # 10 tokens: blocks 0,1 full, block 2 holds 2
    prefill(bm, a)
    assert bm.blocks[0].token_ids == (1, 2, 3, 4) and bm.blocks[1].token_ids == (5, 6, 7, 8)
    assert bm.blocks[2].hash is None and len(bm.hash_to_block_id) == 2
    h0 = bm.chain_hash(None, (1, 2, 3, 4))
    assert bm.blocks[0].hash == h0 and bm.blocks[1].hash == bm.chain_hash(h0, (5, 6, 7, 8))

    # Decode: token 11 is sampled and computed at position 10; block 2 still has a free slot, so no hash.
    # Token 12 computed at position 11 fills block 2, which is hashed then; token 13 needs a fresh block.
    for token, full in ((11, False), (12, True)):
        a.token_ids.append(token)
        bm.may_append(a)
        a.num_scheduled_tokens = 1
        a.num_cached_tokens += 1
        bm.hash_blocks(a)
        assert (bm.blocks[2].hash is not None) == full
    assert bm.blocks[2].token_ids == (9, 10, 11, 12) and bm.blocks[2].hash == bm.chain_hash(bm.blocks[1].hash,
                                                                                          (9, 10, 11, 12))
    a.token_ids.append(13)
    bm.may_append(a)
    assert a.block_table == [0, 1, 2, 3]


def test_shared_prefix_is_ref_counted_and_released():
    bm = BlockManager(8, BS)
    a = Sequence(0, list(range(1, 11)))
    b = Sequence(1, list(range(1, 9)) + [77, 78, 79])    # same first 2 blocks
    prefill(bm, a)
    assert prefill(bm, b) == [0, 1]
    assert b.block_table[:2] == [0, 1] and bm.num_prefix_hit_tokens == 8
    assert ref_counts(bm)[:2] == [2, 2]
    assert bm.num_free_blocks == 8 - 3 - 1
    bm.deallocate(a)
    assert ref_counts(bm)[:3] == [1, 1, 0]
    bm.deallocate(b)
    assert ref_counts(bm) == [0] * 8 and bm.num_free_blocks == 8


def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(8, BS)
    prefill(bm, Sequence(0, list(range(1, 9))))           # 8 tokens, 2 full blocks, both hashed
    assert len(bm.hash_to_block_id) == 2
    same = Sequence(1, list(range(1, 9)))
    assert bm.can_allocate(same) == [0]                   # not [0, 1]: the last block is recomputed
    assert bm.can_allocate(Sequence(2, list(range(1, 10)))) == [0, 1]


def test_freed_blocks_keep_their_hash_and_are_re_hit():
    bm = BlockManager(8, BS)
    a = Sequence(0, list(range(1, 11)))
    prefill(bm, a)
    bm.deallocate(a)
    assert bm.blocks[0].hash is not None and bm.blocks[1].hash is not None and len(bm.hash_to_block_id) == 2
    again = Sequence(1, list(range(1, 11)))
    assert prefill(bm, again) == [0, 1]                   # revived from the free list
    assert ref_counts(bm)[:2] == [1, 1] and 0 not in bm.free_block_ids and 1 not in bm.free_block_ids


def test_can_allocate_counts_revived_free_blocks():
    # 4 blocks. A (9 tokens) takes 0,1,2 and is freed: all 4 free, blocks 0,1 cached.
    # B (1..8 + 3 more = 11 tokens, 3 blocks) hits 0,1 and needs one fresh block: fits.
    # With C holding 2 blocks, only 2 are free and both are B's hits, so B needs 3 and does not fit.
    bm = BlockManager(4, BS)
    a = Sequence(0, list(range(1, 10)))
    prefill(bm, a)
    bm.deallocate(a)
    b = Sequence(1, list(range(1, 9)) + [90, 91, 92])
    assert bm.can_allocate(b) == [0, 1]
    c = Sequence(2, [40] * 8)
    prefill(bm, c)                                         # takes the least recently freed: 3, then 2
    assert c.block_table == [3, 2]
    assert sorted(bm.free_block_ids) == [0, 1]
    assert bm.can_allocate(b) is None


def test_least_recently_freed_is_reused_first_tail_blocks_before_prefix():
    bm = BlockManager(6, BS)
    a = Sequence(0, list(range(1, 13)))                    # blocks 0,1,2
    prefill(bm, a)
    bm.deallocate(a)
    assert list(bm.free_block_ids) == [3, 4, 5, 2, 1, 0]   # never used first, then a's tail before its head


def test_blocks_that_served_a_hit_are_evicted_after_one_off_blocks():
    # a "system prompt" of 2 blocks serves a hit, then sits idle while one-off requests come and go: under
    # pressure their blocks are taken before the prompt's, though the prompt's were freed earlier
    bm = BlockManager(8, BS)
    system = list(range(1, 9))
    first, second = Sequence(0, system + [20]), Sequence(1, system + [21])
    prefill(bm, first)
    assert prefill(bm, second) == first.block_table[:2]
    prefix = first.block_table[:2]
    assert all(bm.blocks[b].reused for b in prefix) and not bm.blocks[first.block_table[2]].reused
    bm.deallocate(first)
    bm.deallocate(second)
    assert bm.free_ids()[-2:] == prefix[::-1]            # last in line: tail first within the segment too
    for i in range(3):                                   # one-off prompts of 6 blocks: all but the prefix's
        other = Sequence(10 + i, [100 + i] * 24)
        prefill(bm, other)
        assert not set(prefix) & set(other.block_table)
        bm.deallocate(other)
    third = Sequence(20, system + [22])
    assert prefill(bm, third) == prefix
    bm.deallocate(third)
    big = Sequence(21, [7] * 32)                          # the whole pool: the prefix's blocks are taken last
    prefill(bm, big)
    assert big.block_table[-2:] == prefix[::-1] and not any(bm.blocks[b].reused for b in big.block_table)
    bm.deallocate(big)
    assert bm.can_allocate(Sequence(22, system + [23])) == []


def test_reusing_a_freed_cached_block_evicts_it():
    bm = BlockManager(4, BS)
    a = Sequence(0, list(range(1, 9)))                     # blocks 0,1, both cached
    prefill(bm, a)
    bm.deallocate(a)                                       # free: 2, 3, 1, 0
    hashes = {bm.blocks[0].hash, bm.blocks[1].hash}
    other = Sequence(1, [60] * 12)                         # 3 blocks: 2, 3 and 1 (evicted)
    prefill(bm, other)
    assert other.block_table == [2, 3, 1]
    assert bm.blocks[1].token_ids == (60,) * 4             # rehashed with its new content
    assert bm.hash_to_block_id.get(bm.chain_hash(bm.blocks[0].hash, (5, 6, 7, 8))) is None
    assert bm.hash_to_block_id[bm.blocks[0].hash] == 0     # block 0 was not reused: still a hit
    bm.deallocate(other)
    again = Sequence(2, list(range(1, 10)))
    assert bm.can_allocate(again) == [0]                   # only the surviving block is reused
    assert hashes & set(bm.hash_to_block_id) == {bm.blocks[0].hash}


def test_block_taken_fresh_loses_hash_only_if_it_owns_the_entry():
    # Two sequences computed the same block at the same time (no hit possible): both get the same hash,
    # the map points at the later one. Reusing the earlier block must not drop the later block's entry.
    bm = BlockManager(6, BS)
    a, b = Sequence(0, [1, 2, 3, 4, 5]), Sequence(1, [1, 2, 3, 4, 6])
    bm.allocate(a, [])
    bm.allocate(b, [])
    for s in (a, b):
        s.num_scheduled_tokens, s.num_cached_tokens = 5, 5
        bm.hash_blocks(s)
    h = bm.chain_hash(None, (1, 2, 3, 4))
    assert bm.blocks[0].hash == bm.blocks[2].hash == h and bm.hash_to_block_id[h] == 2
    bm.deallocate(a)
    bm.deallocate(b)
    filler = Sequence(2, [9] * 16)                         # takes 4, 5, 1, 0 (and block 0's stale hash)
    prefill(bm, filler)
    assert 0 in filler.block_table and 2 not in filler.block_table
    assert bm.hash_to_block_id[h] == 2 and bm.can_allocate(Sequence(3, [1, 2, 3, 4, 7])) == [2]


def test_may_append_on_block_boundaries():
    bm = BlockManager(3, BS)
    s = Sequence(0, [1, 2, 3, 4])
    prefill(bm, s)
    s.token_ids.append(5)                                  # position 4 needs a second block
    assert bm.can_append(s)
    bm.may_append(s)
    assert s.block_table == [0, 1]
    s.token_ids.append(6)                                  # position 5 is in block 1: no new block
    bm.may_append(s)
    assert s.block_table == [0, 1]
    hog = Sequence(1, [7])
    prefill(bm, hog)
    s.token_ids += [7, 8, 9]                               # position 8 needs a block; none is free
    assert not bm.can_append(s)


def test_prefix_caching_disabled():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = Sequence(0, list(range(1, 11)))
    prefill(bm, a)
    bm.deallocate(a)
    assert not bm.hash_to_block_id and all(b.hash is None for b in bm.blocks)
    assert bm.can_allocate(Sequence(1, list(range(1, 11)))) == []


# ---------------------------------------------------------------- hash collisions

@pytest.fixture
def colliding_hash(monkeypatch):
    """Every chain hash is the same value: only the token verification stands between a request and
    someone else's KV."""
    monkeypatch.setattr(BlockManager, "chain_hash", staticmethod(lambda prefix_hash, token_ids: 12345))


def test_collision_with_different_tokens_is_not_reused(colliding_hash):
    bm = BlockManager(8, BS)
    a = Sequence(0, [1, 2, 3, 4, 9])
    prefill(bm, a)
    b = Sequence(1, [5, 6, 7, 8, 9])                       # same (constant) hash, different tokens
    assert bm.can_allocate(b) == []
    assert prefill(bm, b) == [] and bm.num_prefix_hit_tokens == 0
    assert set(b.block_table).isdisjoint(a.block_table)
    c = Sequence(2, [1, 2, 3, 4, 10])                      # the map now points at b's block: c misses too
    assert bm.can_allocate(c) == []


class KVModel:
    """slot -> the full token prefix at that position; a row must read exactly its own prefix."""

    def __init__(self, bs):
        self.bs, self.kv = bs, {}

    def __call__(self, plan, rows):
        out = []
        for r, seq in enumerate(rows):
            lo, hi = plan.cu_seqlens_q[r], plan.cu_seqlens_q[r + 1]
            table = plan.block_tables[r]
            for p in range(int(plan.positions[lo])):
                got = self.kv.get(int(table[p // self.bs]) * self.bs + p % self.bs)
                assert got == tuple(seq.token_ids[:p + 1]), \
                    f"sequence {seq.seq_id} reads KV of {got} at position {p}, wants its own prefix"
            for j in range(lo, hi):
                p = int(plan.positions[j])
                self.kv[int(plan.slot_mapping[j])] = tuple(seq.token_ids[:p + 1])
            out.append(100 + sum(seq.token_ids[:int(plan.context_lens[r])]) % 97)   # depends on the whole prefix
        return out


def run_with_kv_model(prompts, bs=BS):
    sched = Scheduler(SchedulerConfig(num_kvcache_blocks=16, kvcache_block_size=bs, max_model_len=40))
    model, done = KVModel(bs), []
    for i, prompt in enumerate(prompts):        # one after another, so later prompts can hit earlier ones
        seq = Sequence(i, prompt, max_tokens=3)
        sched.add(seq)
        while (step := sched.schedule()) is not None:
            plan = step.plan
            sched.postprocess(model(plan, list(sched.scheduled)))
        done.append(seq)
    assert all(b.ref_count == 0 for b in sched.block_manager.blocks)
    return [s.completion_token_ids for s in done], sched.block_manager


def kv_model_reference(prompt, n=3):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(100 + sum(tokens) % 97)
    return tokens[len(prompt):]


def test_collision_end_to_end_tokens_unchanged(colliding_hash):
    # The map holds one entry (the last block registered). Prompt 2 registers (5,6,7,8) at position 0, so
    # prompt 3 hits it legitimately; prompt 4's (1,2,3,4) finds (5,6,7,8) under the same hash and misses.
    prompts = [[1, 2, 3, 4, 9], [5, 6, 7, 8, 9], [5, 6, 7, 8, 1], [1, 2, 3, 4, 2]]
    got, bm = run_with_kv_model(prompts)
    assert got == [kv_model_reference(p) for p in prompts]
    assert bm.num_prefix_hit_tokens == 4


@pytest.mark.parametrize("prompts", [
    [[1, 2, 3, 4, 5, 6, 7, 8, 9], [5, 6, 7, 8, 0]],
    [[1, 2, 3, 4, 9], [1, 2, 3, 4, 1, 2, 3, 4, 9]],
], ids=["block-at-another-position", "same-block-twice"])
def test_collision_never_hands_out_kv_of_another_prefix(colliding_hash, prompts):
    got, bm = run_with_kv_model(prompts)


@pytest.fixture
def parent_blind_hash(monkeypatch):
    """A block's hash ignores the blocks before it: equal blocks collide at every depth, so a lookup past
    depth 0 can find a block computed after another parent, and only the parent check stands in the way."""
    monkeypatch.setattr(BlockManager, "chain_hash", staticmethod(lambda prefix_hash, token_ids: hash(token_ids)))


def test_child_of_a_reused_parent_is_not_a_hit(parent_blind_hash):
    # A = X T 13: block `parent` holds X, block `child` holds T computed after X; both freed, both cached.
    x, t, y = (1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)
    bm = BlockManager(6, BS)
    a = Sequence(0, [*x, *t, 13])
    prefill(bm, a)
    parent, child = a.block_table[:2]
    bm.deallocate(a)
    # The parent is reused before its child (LRU with tail-first freeing never does this, but the hit check
    # must not depend on the eviction order) and is registered again, now holding Y at depth 0.
    bm.free_block_ids.move_to_end(parent, last=False)
    b = Sequence(1, [*y, 14])
    prefill(bm, b)
    assert b.block_table[0] == parent and bm.blocks[parent].token_ids == y
    assert bm.blocks[child].token_ids == t and bm.blocks[child].parent == parent
    # Y T 15: depth 0 hits `parent` (Y, legitimately); depth 1 finds `child` by its hash, with the right tokens
    # and the same parent id, but its KV was computed after X: the parent's version is what tells.
    c = Sequence(2, [*y, *t, 15])
    assert bm.can_allocate(c) == [parent]
    assert prefill(bm, c) == [parent] and c.block_table[1] != child


# ---------------------------------------------------------------- blocks released for a sliding window

def test_blocks_before_the_window_are_released_and_stay_cached():
    bm = BlockManager(12, BS, window=6)
    a = Sequence(0, list(range(1, 23)))         # 22 tokens: blocks 0..5
    prefill(bm, a)
    bm.release_outside_window(a)
    # the next query (position 22) reads from 17 on: blocks 0..3 end before it, block 3 is kept as slack
    assert a.num_window_freed == 3 and bm.live_blocks(a) == a.block_table[3:] and bm.num_free_blocks == 9
    assert ref_counts(bm)[:6] == [0, 0, 0, 1, 1, 1] and bm.num_window_freed_blocks == 3
    bm.release_outside_window(a)
    assert a.num_window_freed == 3, "releasing twice frees nothing more"
    b = Sequence(1, list(range(1, 23)) + [99])  # a's prompt: its released blocks are hits, KV intact
    assert prefill(bm, b) == a.block_table[:5]
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 12 and ref_counts(bm) == [0] * 12, "no block freed twice, none leaked"


def test_a_released_block_reused_for_other_tokens_is_never_a_hit():
    bm = BlockManager(7, BS, window=4)
    a = Sequence(0, list(range(1, 18)))         # 17 tokens: blocks 0..4
    prefill(bm, a)
    bm.release_outside_window(a)                 # reads from 14 on: blocks 0, 1 released (2 is slack)
    assert a.num_window_freed == 2
    other = Sequence(1, [70, 71, 72, 73, 74, 75, 76, 77, 78])     # takes the two free blocks, then block 0
    prefill(bm, other)
    assert bm.blocks[a.block_table[0]].token_ids != (1, 2, 3, 4)
    again = Sequence(2, list(range(1, 18)))
    assert bm._cached_prefix(again) == [], "block 0 holds other tokens now: the chain stops before it"


def test_a_fork_shares_only_the_live_blocks():
    sched = Scheduler(SchedulerConfig(num_kvcache_blocks=16, kvcache_block_size=BS, max_model_len=40,
                                      max_num_batched_tokens=8, kv_window=5))
    from nanovllm_tp import SamplingParams
    parent = Sequence(0, list(range(1, 20)), SamplingParams(n=2, temperature=0, max_tokens=3))
    child = Sequence(1, list(parent.token_ids), parent.params, index=1)
    parent.forks = [child]
    sched.add(parent)
    while parent.num_cached_tokens < parent.num_prompt_tokens:     # chunks of 8, then the fork
        step = sched.schedule()
        sched.postprocess([7] * len(step.sampling.seqs))
    bm = sched.block_manager
    assert parent.num_window_freed > 0 and child.num_window_freed == parent.num_window_freed
    for block_id in bm.live_blocks(child)[:-1]:
        assert bm.blocks[block_id].ref_count == 2
    sched.finish(parent, "abort")
    sched.finish(child, "abort")
    assert bm.num_free_blocks == 16
