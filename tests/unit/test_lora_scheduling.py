"""LoRA on rank 0, torch-free: the LRU of adapter slots in the scheduler (a request waits while every slot is
held), the prefix cache keyed by adapter, and the plan fields every rank checks."""
import numpy as np
import pytest

from nanovllm_tp.lora import LoRARequest
from nanovllm_tp.scheduler import BlockManager, Scheduler, SchedulerConfig, Sequence, StepPlan
from nanovllm_tp.scheduler.plan import PlanError
from nanovllm_tp.workers.plan_check import PlanLimits, check_plan

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in ((1, "a"), (2, "b"), (3, "c")))


def seq(i: int, lora, n: int = 6, max_tokens: int = 4) -> Sequence:
    return Sequence(i, [(5 * i + j) % 97 + 1 for j in range(n)], max_tokens=max_tokens, ignore_eos=True, lora=lora)


def scheduler(max_loras: int, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(num_kvcache_blocks=64, kvcache_block_size=4, max_model_len=64,
                                     max_num_seqs=8, max_loras=max_loras, **kw))


def run(sched: Scheduler) -> list[StepPlan]:
    plans = []
    while sched.has_unfinished():
        step = sched.schedule()
        plans.append(step.plan)
        sched.postprocess([7] * len(step.sampling.seqs))
    return plans


def test_slots_load_once_and_rows_carry_them():
    sched = scheduler(2)
    for i, lora in enumerate((A, None, B, A)):
        sched.add(seq(i, lora))
    plans = run(sched)
    first = plans[0]
    assert first.lora_loads == [[0, 1, "/adapters/a"], [1, 2, "/adapters/b"]]
    assert first.lora_slot.tolist() == [0, -1, 1, 0]
    assert all(p.lora_loads is None for p in plans[1:])
    assert all(p.lora_slot.tolist() == [0, -1, 1, 0] for p in plans[1:])
    assert sched.lora_slots.holders == [0, 0]


def test_a_request_waits_for_a_slot_and_the_lru_one_is_reused():
    sched = scheduler(2)
    for i, lora in enumerate((A, B, C, None)):
        sched.add(seq(i, lora, max_tokens=3 + 2 * i))
    plans = run(sched)
    # C waits (both slots held) and, FCFS, so does the base request behind it
    assert plans[0].lora_slot.tolist() == [0, 1]
    loads = [(p.step_id, load) for p in plans for load in p.lora_loads or ()]
    assert [load for _, load in loads] == [[0, 1, "/adapters/a"], [1, 2, "/adapters/b"], [0, 3, "/adapters/c"]]
    assert sched.lora_slots.num_loads == 3
    step_c = loads[-1][0]
    # C took A's slot (least recently used) once A had finished; B still ran beside it
    assert plans[step_c - 1].lora_slot.tolist()[:2] == [1, 0]


def test_preemption_gives_the_slot_back():
    sched = Scheduler(SchedulerConfig(num_kvcache_blocks=4, kvcache_block_size=4, max_model_len=16, max_num_seqs=4,
                                      max_loras=1))
    sched.add(seq(0, A, n=4, max_tokens=8))
    sched.add(seq(1, A, n=4, max_tokens=8))
    run(sched)
    assert sched.num_preemptions > 0 and sched.lora_slots.holders == [0]


def test_prefix_cache_is_keyed_by_adapter():
    bm = BlockManager(32, 4)
    prompt = list(range(1, 14))

    def prefill(s):
        hits = bm.can_allocate(s)
        bm.allocate(s, hits)
        s.num_scheduled_tokens = s.num_tokens - s.num_cached_tokens
        s.num_cached_tokens = s.num_tokens
        bm.hash_blocks(s)
        return hits

    assert prefill(Sequence(0, prompt, lora=A)) == []
    assert prefill(Sequence(1, prompt)) == []                   # base: A's blocks are not its
    assert prefill(Sequence(2, prompt, lora=B)) == []
    assert len(prefill(Sequence(3, prompt, lora=A))) == 3       # the same adapter hits
    assert len(prefill(Sequence(4, prompt))) == 3


def test_plan_fields_roundtrip_and_are_checked():
    sched = scheduler(2)
    sched.add(seq(0, A))
    plan = StepPlan.decode(sched.schedule().plan.encode())
    assert plan.lora_loads == [[0, 1, "/adapters/a"]] and plan.lora_slot.dtype == np.int32
    limits = PlanLimits(num_blocks=64, block_size=4, max_model_len=64, vocab_size=100, max_loras=2)
    check_plan(plan, limits)
    with pytest.raises(PlanError, match="lora_slot"):
        check_plan(plan, PlanLimits(64, 4, 64, 100))               # LoRA off on this rank
    for bad in ([[2, 1, "/a"]], [[0, 0, "/a"]], [[0, 1, "relative"]]):
        plan.lora_loads = bad
        with pytest.raises(PlanError, match="lora_loads"):
            check_plan(plan, limits)
    plan.lora_loads, plan.lora_slot = None, np.array([5], np.int32)
    with pytest.raises(PlanError, match="lora_slot"):
        check_plan(plan, limits)
    raw = plan.encode().replace(b"lora_slot", b"lora_slox")
    assert StepPlan.decode(raw).lora_slot is None


def test_a_forgotten_adapter_keeps_its_slot_until_its_rows_leave():
    from nanovllm_tp.scheduler.lora_slots import LoRASlots
    slots = LoRASlots(1)
    running = seq(0, A)
    assert slots.acquire(running) and slots.take_loads() == [[0, 1, "/adapters/a"]]
    slots.forget(1)                                          # removed while a row still runs with it
    again = seq(1, LoRARequest("a", 1, "/adapters/a-v2"))
    assert not slots.can_acquire(again) and not slots.acquire(again)    # the slot is still the running row's
    slots.release(running)
    assert slots.acquire(again) and slots.take_loads() == [[0, 1, "/adapters/a-v2"]]   # reloaded, new path
