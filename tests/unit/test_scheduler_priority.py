"""The priority scheduling policy (vLLM's: lower priority value first, then arrival) on the scheduler with the
fake model of test_scheduler: waiting order, which sequence a full pool preempts, a high-priority arrival
preempting lower-priority work to start at once, and every sequence still exact."""
from nanovllm_tp.scheduler import Sequence
from tests.unit.test_scheduler import FakeModel, make_scheduler, postprocess, reference, run

MAX_LEN = 64


def seq(i: int, priority: int, max_tokens: int = 20, prompt_len: int = 6) -> Sequence:
    return Sequence(i, [100 + 7 * i + j for j in range(prompt_len)], temperature=0.0, max_tokens=max_tokens,
                    ignore_eos=True, priority=priority)


def exact(seqs, max_len: int = MAX_LEN) -> None:
    for s in seqs:
        want, reason = reference(s.token_ids[:s.num_prompt_tokens], s.params.max_tokens, max_len, ignore_eos=True)
        assert s.completion_token_ids == want and s.finish_reason == reason, s


def test_waiting_is_kept_in_priority_then_arrival_order():
    sched = make_scheduler(max_model_len=MAX_LEN, scheduling_policy="priority")
    seqs = [seq(i, p) for i, p in enumerate([2, 0, 1, 0, -3, 2])]
    for s in seqs:
        sched.add(s)
    assert [s.seq_id for s in sched.waiting] == [4, 1, 3, 2, 0, 5]
    fcfs = make_scheduler(max_model_len=MAX_LEN)
    for s in [seq(i, 0) for i in range(4)]:
        fcfs.add(s)
    assert [s.seq_id for s in fcfs.waiting] == [0, 1, 2, 3]


def fill_then_arrive(policy: str):
    """Four priority-5 sequences fill a 16-block pool (block size 4); then a priority-0 one arrives. Returns
    (scheduler, the late sequence, steps until its first token, the others)."""
    sched = make_scheduler(num_blocks=16, max_model_len=MAX_LEN, scheduling_policy=policy, max_num_seqs=4)
    model = FakeModel(sched.block_size)
    low = [seq(i, 5, max_tokens=40) for i in range(4)]
    for s in low:
        sched.add(s)
    for _ in range(6):
        postprocess(sched, model(sched.schedule().plan))
    late = seq(9, 0, max_tokens=8)
    sched.add(late)
    steps = 0
    while not late.completion_token_ids:
        postprocess(sched, model(sched.schedule().plan))
        steps += 1
    run(sched, model)
    return sched, late, steps, low


def test_a_high_priority_arrival_preempts_lower_work_and_starts_at_once():
    sched, late, steps, low = fill_then_arrive("priority")
    assert steps == 1 and sched.num_preemptions >= 1
    exact([late, *low])
    fcfs, late_fcfs, steps_fcfs, low_fcfs = fill_then_arrive("fcfs")
    assert steps_fcfs > 10            # under fcfs it waits for a running sequence to finish
    exact([late_fcfs, *low_fcfs])


def test_a_full_pool_preempts_the_lowest_priority_first():
    """Decodes outgrow the pool: the sequence preempted is the one with the largest (priority, arrival), not
    the newest."""
    sched = make_scheduler(num_blocks=10, max_model_len=40, scheduling_policy="priority")
    model = FakeModel(sched.block_size)
    seqs = [seq(0, 1, 30), seq(1, 9, 30), seq(2, 0, 30)]      # the newest has the highest priority
    for s in seqs:
        sched.add(s)
    first_preempted = []

    def watch(sched, plan, rows):
        if sched.num_preemptions and not first_preempted:
            first_preempted.extend(s.seq_id for s in sched.waiting)

    run(sched, model, on_step=watch)
    assert first_preempted == [1]
    exact(seqs, 40)
