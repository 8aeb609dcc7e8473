"""The data-parallel request router (nanovllm_tp/serving/router.py): each policy's choice from the replicas' loads,
prefix affinity and its limits (load, adapter, forgetting, a bounded record), the errors, the counters, the cost."""
import time

import pytest

from nanovllm_tp.serving.router import (POLICIES, LeastLoadRouter, NoReplica, PrefixAwareRouter, ReplicaLoad,
                                        block_hashes, make_router)

BS = 16


def idle(n: int) -> list[ReplicaLoad]:
    return [ReplicaLoad() for _ in range(n)]


def prompt(seed: int, blocks: int = 4, tail: int = 0) -> list[int]:
    """`blocks` full blocks of tokens that only prompts of the same seed share, then `tail` more tokens."""
    return [seed * 100_000 + t for t in range(blocks * BS)] + [7] * tail


def test_round_robin_cycles_and_skips_dead():
    router = make_router("round-robin", 3)
    assert [router.route([1], idle(3)) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    loads = idle(3)
    loads[1].alive = False
    assert [router.route([1], loads) for _ in range(4)] == [0, 2, 0, 2]
    loads[0].alive = False
    assert [router.route([1], loads) for _ in range(2)] == [2, 2]
    assert router.counters() == {"routed": [4, 2, 6], "prefix_hits": 0, "policy": "round-robin"}


def test_least_load_picks_least_loaded():
    router = make_router("least-load", 3)
    loads = [ReplicaLoad(running=4, waiting=1), ReplicaLoad(running=1, waiting=3), ReplicaLoad(running=2)]
    assert router.route([1], loads) == 2
    loads[2].alive = False
    assert router.route([1], loads) == 1         # 4 requests against 5
    loads[1].kv_usage, loads[0] = 0.9, ReplicaLoad(running=4, kv_usage=0.2)
    assert router.route([1], loads) == 0         # equal load: the lower KV usage


def test_least_load_spreads_a_burst_of_equal_loads():
    router = make_router("least-load", 2)
    loads = idle(2)          # the replicas have not reported the burst yet
    picks = [router.route([1], loads) for _ in range(4)]
    assert sorted(picks) == [0, 0, 1, 1]
    assert router.counters()["routed"] == [2, 2]


def test_least_load_lora_breaks_ties_only():
    router = make_router("least-load", 3)
    loads = [ReplicaLoad(running=2), ReplicaLoad(running=2, loras=frozenset({5})), ReplicaLoad(running=2)]
    assert router.route([1], loads, lora_id=5) == 1
    assert router.route([1], loads, lora_id=5) == 1          # fewer routed elsewhere, but the adapter wins the tie
    loads[1] = ReplicaLoad(running=3, loras=frozenset({5}))
    assert router.route([1], loads, lora_id=5) != 1           # a busier replica loses despite the adapter
    assert router.route([1], idle(3), lora_id=9) in (0, 2)    # an adapter nobody has: plain least-load


def test_prefix_aware_sticks_to_the_replica_of_a_shared_prefix():
    router = make_router("prefix-aware", 4, BS)
    first = router.route(prompt(1, tail=5), idle(4))
    for i in range(8):       # same 4 leading blocks, different tails; the loads do not change between routes
        assert router.route(prompt(1, tail=5) + [i] * (i * 20), idle(4)) == first
    assert router.counters()["prefix_hits"] == 8
    assert router.counters()["routed"][first] == 9


def test_prefix_aware_spreads_distinct_prefixes():
    router = make_router("prefix-aware", 4, BS)
    picks = [router.route(prompt(seed), idle(4)) for seed in range(8)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert router.counters()["prefix_hits"] == 0
    assert [router.route(prompt(seed), idle(4)) for seed in range(8)] == picks    # each prefix where it went


def test_prefix_aware_sends_a_new_prefix_to_the_replica_holding_fewest_blocks():
    """A miss goes to the smallest record among the replicas within the load threshold, whatever the loads' order
    there (a replica 3 requests busier, under the threshold of 8, takes it if it holds fewer blocks); equal
    records go by load; past the threshold, load decides."""
    router = make_router("prefix-aware", 2, BS)
    busier = [ReplicaLoad(), ReplicaLoad(running=3)]
    assert router.route(prompt(1), idle(2)) == 0
    assert router.route(prompt(2), busier) == 1                  # 0 blocks against 4
    assert router.route(prompt(3, blocks=8), idle(2)) == 0       # 4 against 4
    assert router.route(prompt(4), busier) == 1                  # 4 against 12
    assert router.route(prompt(5), [ReplicaLoad(), ReplicaLoad(running=9)]) == 0
    assert router.counters()["prefix_hits"] == 0


def test_prefix_aware_prefixes_split_evenly_under_changing_loads():
    """8 shared prefixes of equal length, their requests routed as loads come and go within the threshold: each
    replica of two ends up owning 4 (least-load alone leaves them as the loads fall: 3 and 5, or worse)."""
    import random
    rng = random.Random(0)
    router, owned = make_router("prefix-aware", 2, BS), [set(), set()]
    for _ in range(64):
        seed = rng.randrange(8)
        loads = [ReplicaLoad(running=rng.randrange(4)), ReplicaLoad(running=rng.randrange(4))]
        owned[router.route(prompt(seed, tail=rng.randrange(BS)), loads)].add(seed)
    assert [len(o) for o in owned] == [4, 4]


def test_prefix_aware_prefers_the_longest_match():
    router = make_router("prefix-aware", 2, BS)
    full = prompt(3, blocks=6)
    assert router.route(full[:2 * BS], idle(2)) == 0
    assert router.route(full[:5 * BS], [ReplicaLoad(alive=False), ReplicaLoad()]) == 1
    assert router.route(full, [ReplicaLoad(waiting=3), ReplicaLoad(waiting=4)]) == 1    # 5 blocks beat 2
    assert router.route(full[:2 * BS + 3], [ReplicaLoad(waiting=3), ReplicaLoad(waiting=4)]) == 0   # tie: load


def test_prefix_aware_falls_back_to_least_load_past_the_threshold():
    router = make_router("prefix-aware", 3, BS, load_threshold=4, idle_routes=0)     # idle counts at once
    home = router.route(prompt(2), idle(3))
    loads = idle(3)
    loads[home].waiting = 4          # at the threshold: affinity holds
    assert router.route(prompt(2), loads) == home
    loads[home].waiting = 5          # past it: the least loaded instead
    other = router.route(prompt(2), loads)
    assert other != home
    hits = router.counters()["prefix_hits"]
    assert hits == 1
    loads = idle(3)
    loads[other].running = 1         # both now hold it: the less loaded of them, a hit again
    assert router.route(prompt(2), loads) == home
    assert router.counters()["prefix_hits"] == hits + 1


def test_prefix_aware_defaults_sixteen_requests_or_eight_past_a_replica_left_idle():
    """Sending a request away from the replica that holds its prefix costs its prefill: against a busy replica
    the holder keeps it up to miss_threshold (16) requests more; against a replica that had nothing to do at more
    than idle_routes (8) routes in a row, up to load_threshold (8)."""
    router = PrefixAwareRouter(2, BS)
    assert router.route(prompt(4), idle(2)) == 0
    for other, holder, expected in ((1, 9, 0), (1, 17, 0), (1, 18, 1), (4, 20, 0), (4, 21, 1)):
        loads = [ReplicaLoad(running=holder), ReplicaLoad(running=other)]
        assert router.route(prompt(4), loads) == expected, (other, holder)
        if expected == 1:
            router.forget_replica(1)          # the copy forgotten: the next case starts from one holder again
    # replica 1 idle: the holder keeps the prefix through 8 routes (the idle one may get work any moment) ...
    for _ in range(8):
        assert router.route(prompt(4), [ReplicaLoad(running=12), ReplicaLoad()]) == 0
    # ... then the idle replica is spare capacity: past load_threshold, a copy goes there
    assert router.route(prompt(4), [ReplicaLoad(running=8), ReplicaLoad()]) == 0
    assert router.route(prompt(4), [ReplicaLoad(running=9), ReplicaLoad()]) == 1
    # a prefix nobody holds goes to a replica within load_threshold of the least loaded
    assert router.route(prompt(8), [ReplicaLoad(running=10), ReplicaLoad(running=1)]) == 1


def test_prefix_aware_holders_within_patience_compete_on_their_match():
    """Two replicas hold the prompt's first blocks, one of them its whole chain: the longer match wins while its
    replica is within the patience, even past load_threshold; past it, the shorter match (a partial hit) does."""
    router = make_router("prefix-aware", 3, BS, load_threshold=2, miss_threshold=6)
    full = prompt(9, blocks=6)
    assert router.route(full, idle(3)) == 0
    assert router.route(full[:2 * BS], [ReplicaLoad(running=8), ReplicaLoad(running=1), ReplicaLoad(running=1)]) == 1
    loads = [ReplicaLoad(running=6), ReplicaLoad(running=1), ReplicaLoad(running=1)]
    assert router.route(full, loads) == 0                 # 5 over the least loaded: within miss_threshold
    loads[0].running = 8
    assert router.route(full, loads) == 1                 # past it: replica 1's two blocks, not replica 2's none


def test_prefix_aware_owner_yields_to_a_less_loaded_holder_past_the_load_threshold():
    router = make_router("prefix-aware", 2, BS, load_threshold=2, miss_threshold=6, idle_routes=0)
    assert router.route(prompt(3), idle(2)) == 0
    assert router.route(prompt(3), [ReplicaLoad(running=5), ReplicaLoad(running=0)]) == 1     # idle: a copy
    busy = [ReplicaLoad(running=4), ReplicaLoad(running=1)]
    assert router.route(prompt(3), busy) == 1            # both hold it: the owner only within 2 of the other
    busy[0].running = 3
    assert router.route(prompt(3), busy) == 0


def test_prefix_aware_a_different_adapter_is_not_a_hit():
    router = make_router("prefix-aware", 2, BS)
    assert router.route(prompt(5), idle(2), lora_id=1) == 0
    assert router.route(prompt(5), idle(2), lora_id=2) == 1       # same tokens, other adapter: by load
    assert router.route(prompt(5), idle(2)) == 0 and router.counters()["prefix_hits"] == 0    # nor no adapter
    assert router.route(prompt(5), idle(2), lora_id=2) == 1 and router.counters()["prefix_hits"] == 1


def test_forget_replica_drops_the_affinity():
    router = make_router("prefix-aware", 2, BS)
    home = router.route(prompt(6), idle(2))
    assert router.route(prompt(6), idle(2)) == home
    assert router.blocks_held(home) == 4
    router.forget_replica(home)
    assert router.blocks_held(home) == 0
    assert router.route(prompt(6), idle(2)) != home          # by load now: `home` was routed to more
    assert router.counters()["prefix_hits"] == 1
    for policy in ("round-robin", "least-load"):
        other = make_router(policy, 2)
        other.forget_replica(1)
        assert other.route([1], idle(2)) == 0


def test_dead_replica_is_never_chosen_even_holding_the_prefix():
    router = make_router("prefix-aware", 2, BS)
    home = router.route(prompt(7), idle(2))
    loads = idle(2)
    loads[home].alive = False
    assert router.route(prompt(7), loads) == 1 - home


def test_record_stays_within_capacity():
    router = make_router("prefix-aware", 2, BS, capacity=10, max_blocks=4)
    for seed in range(200):
        router.route(prompt(seed, blocks=6), idle(2))
        assert router.blocks_held(0) <= 10 and router.blocks_held(1) <= 10
        assert len(router._holders) <= 20      # the hash -> replicas index is bounded with them
    home = router.route(prompt(0, blocks=6), idle(2))      # evicted long ago: a miss
    assert router.counters()["prefix_hits"] == 0
    assert router.route(prompt(0, blocks=6), idle(2)) == home
    assert router.counters()["prefix_hits"] == 1


def test_eviction_keeps_a_prompts_head_longest():
    router = make_router("prefix-aware", 2, BS, capacity=4)
    only_0 = [ReplicaLoad(), ReplicaLoad(alive=False)]
    router.route(prompt(1, blocks=4), only_0)
    router.route(prompt(2, blocks=2), only_0)        # evicts two of prompt 1's four blocks: its last two
    assert router.blocks_held(0) == 4
    assert router.route(prompt(1, blocks=4), [ReplicaLoad(waiting=1), ReplicaLoad()]) == 0   # its head: a hit
    assert router.counters()["prefix_hits"] == 1


def test_short_prompt_routes_by_load_and_records_nothing():
    router = make_router("prefix-aware", 2, BS)
    assert router.route(list(range(BS - 1)), [ReplicaLoad(waiting=2), ReplicaLoad()]) == 1
    assert router.route([], [ReplicaLoad(), ReplicaLoad(waiting=2)]) == 0
    assert router.blocks_held(0) == router.blocks_held(1) == 0
    assert router.counters()["prefix_hits"] == 0


def test_block_hashes_chain_limit_and_adapter_seed():
    a, b = prompt(1, blocks=3), prompt(1, blocks=2) + prompt(2, blocks=1)
    ha, hb = block_hashes(a, BS, 32), block_hashes(b, BS, 32)
    assert len(ha) == 3 and ha[:2] == hb[:2] and ha[2] != hb[2]
    assert block_hashes(a + [1] * (BS - 1), BS, 32) == ha              # a partial block is not hashed
    assert len(block_hashes(prompt(1, blocks=50), BS, 32)) == 32
    assert block_hashes(a, BS, 32, lora_id=3)[0] != ha[0]
    assert block_hashes(a, BS, 32, lora_id=0)[0] != ha[0]


def test_no_replica_when_all_dead():
    dead = [ReplicaLoad(alive=False), ReplicaLoad(alive=False)]
    for policy in POLICIES:
        router = make_router(policy, 2)
        with pytest.raises(NoReplica):
            router.route(prompt(1), dead)
        assert router.counters()["routed"] == [0, 0]
    assert issubclass(NoReplica, RuntimeError)


def test_make_router_refuses_bad_arguments():
    assert set(POLICIES) == {"round-robin", "least-load", "prefix-aware"}
    with pytest.raises(ValueError) as err:
        make_router("random", 2)
    for name in POLICIES:
        assert name in str(err.value)
    with pytest.raises(ValueError):
        make_router("least-load", 0)
    with pytest.raises(ValueError, match="miss_threshold"):
        make_router("prefix-aware", 2, load_threshold=8, miss_threshold=4)
    with pytest.raises(ValueError, match="idle_routes"):
        make_router("prefix-aware", 2, idle_routes=-1)
    with pytest.raises(ValueError):
        make_router("least-load", 2).route([1], idle(3))      # a load per replica
    assert isinstance(make_router("least-load", 2), LeastLoadRouter)


def test_counters_count_routed_and_prefix_hits():
    router = make_router("prefix-aware", 2, BS)
    for seed in (1, 2, 1, 1, 3):
        router.route(prompt(seed), idle(2))
    counters = router.counters()
    assert counters["policy"] == "prefix-aware"
    assert sum(counters["routed"]) == 5 and counters["prefix_hits"] == 2
    counters["routed"][0] += 100                 # a copy
    assert sum(router.counters()["routed"]) == 5


def test_routing_is_deterministic():
    def run() -> list[int]:
        router = make_router("prefix-aware", 3, BS)
        return [router.route(prompt(seed % 5, tail=seed), idle(3)) for seed in range(30)]
    assert run() == run()


def test_route_cost_does_not_grow_with_the_prompt():
    router = make_router("prefix-aware", 64, BS)
    long_prompt = list(range(4000))
    loads = idle(64)
    router.route(long_prompt, loads)
    start = time.perf_counter()
    for _ in range(1000):
        router.route(long_prompt, loads)
    assert (time.perf_counter() - start) / 1000 < 1e-3     # tens of microseconds: generous for a loaded machine


def test_prefix_aware_a_stray_copy_does_not_keep_a_prefix_on_two_replicas():
    """Once a busy owner made a request go elsewhere, both replicas hold the prefix; later requests go back to
    the owner even where the other is less loaded (within the threshold), so the stray copy can age out instead
    of each replica's cache keeping every shared prefix. The owner forgotten, the other holder owns it."""
    router = make_router("prefix-aware", 2, BS, load_threshold=4, idle_routes=0)
    assert router.route(prompt(7), idle(2)) == 0
    assert router.route(prompt(7), [ReplicaLoad(waiting=5), ReplicaLoad()]) == 1        # owner too busy
    for busier in range(5):
        assert router.route(prompt(7), [ReplicaLoad(waiting=busier), ReplicaLoad()]) == 0
    router.forget_replica(0)
    assert router.route(prompt(7), [ReplicaLoad(), ReplicaLoad(waiting=3)]) == 1


def test_prefix_aware_a_short_match_goes_where_a_slot_is_free():
    """--max-num-seqs 4 each: a prompt sharing one block with replica 0, whose slots are taken (3 running and 1 on
    its way), goes to replica 1, which has a free slot; with no slot free anywhere, to the shorter queue. A match of
    queue_match blocks or more keeps patience and waits where its prefix is."""
    router = make_router("prefix-aware", 2, BS)
    short, long_ = prompt(1, blocks=1, tail=5), prompt(2, blocks=8)
    assert router.route(short, idle(2)) == 0 and router.route(long_, idle(2)) == 1
    full = [ReplicaLoad(running=3, pending=1, max_seqs=4), ReplicaLoad(running=1, max_seqs=4)]
    assert not full[0].has_room and full[1].has_room
    assert router.route(short + [9], full) == 1
    assert router.route(short + [9], [ReplicaLoad(running=2, max_seqs=4), full[1]]) == 0     # room at home
    queued = [ReplicaLoad(running=4, waiting=2, max_seqs=4), ReplicaLoad(running=4, waiting=1, max_seqs=4)]
    assert router.route(short + [9], queued) == 1             # no room anywhere: the shorter queue
    home_full = [ReplicaLoad(running=4, max_seqs=4), ReplicaLoad(running=4, waiting=3, max_seqs=4)]
    assert router.route(long_ + [9], home_full[::-1]) == 1    # 8 blocks matched: patience, as without slots
    assert router.route(short + [9], [ReplicaLoad(running=9), ReplicaLoad(running=1)]) == 0     # slots unknown


def test_prefix_aware_a_new_long_prompt_keeps_patience_a_new_short_one_takes_room():
    router = make_router("prefix-aware", 2, BS)
    router.route(prompt(5, blocks=3), idle(2))                # replica 0 now holds more blocks than replica 1
    loads = [ReplicaLoad(running=1, max_seqs=4), ReplicaLoad(running=4, max_seqs=4)]
    assert router.route(prompt(6, blocks=8), loads) == 1      # the fewest blocks, within load_threshold
    assert router.route(prompt(7, blocks=2), loads) == 0     # short: where a slot is free


def test_pending_requests_count_as_load():
    router = make_router("least-load", 2)
    assert router.route([1], [ReplicaLoad(running=1, pending=2), ReplicaLoad(running=2)]) == 1
