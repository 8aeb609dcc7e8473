"""Every rank refuses a plan outside its limits before any kernel runs: PlanError naming the step and the field."""
import json
import os
import subprocess
import sys

import msgpack
import numpy as np
import pytest

from nanovllm_tp.scheduler import DECODE, MIXED, PREFILL, Scheduler, SchedulerConfig, Sequence, StepPlan
from nanovllm_tp.scheduler.plan import KV_READ, KV_WRITE, PlanError
from nanovllm_tp.workers.plan_check import PlanLimits, check_plan

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = PlanLimits(num_blocks=64, block_size=16, max_model_len=256, vocab_size=1000)


def real_plans() -> dict[int, StepPlan]:
    """A prefill, a mixed and a decode plan from the real scheduler (one of each kind)."""
    sched = Scheduler(SchedulerConfig(num_kvcache_blocks=LIMITS.num_blocks, kvcache_block_size=16,
                                      max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256))
    for i, n in enumerate((40, 30, 5)):
        sched.add(Sequence(i, [(7 * i + j) % 1000 for j in range(n)], max_tokens=20, ignore_eos=True))
    plans = {}
    while len(plans) < 3:
        plan = sched.schedule().plan
        plans.setdefault(plan.kind, plan)
        sched.postprocess([3] * plan.num_rows)
    return plans


PLANS = real_plans()


def roundtrip(plan: StepPlan) -> StepPlan:
    return StepPlan.decode(plan.encode())


@pytest.mark.parametrize("kind", [PREFILL, MIXED, DECODE])
def test_real_plans_pass(kind):
    check_plan(roundtrip(PLANS[kind]), LIMITS)


def _with(plan: StepPlan, **arrays) -> StepPlan:
    raw = msgpack.unpackb(plan.encode(), raw=False)
    for name, value in arrays.items():
        raw[name] = value if not isinstance(value, np.ndarray) else [value.dtype.str, list(value.shape),
                                                                     value.tobytes()]
    return StepPlan.decode(msgpack.packb(raw, use_bin_type=True))


def _set(plan: StepPlan, name: str, index, value) -> StepPlan:
    array = getattr(plan, name).copy()
    array[index] = value
    return _with(plan, **{name: array})


BAD = [
    ("block_tables", lambda p: _set(p, "block_tables", (0, 0), 10**6)),
    ("block_tables", lambda p: _set(p, "block_tables", (0, 0), -5)),
    ("block_tables", lambda p: _set(p, "block_tables", (0, 0), -1)),           # padding inside the context
    ("positions", lambda p: _set(p, "positions", -1, 256)),
    ("positions", lambda p: _set(p, "positions", 0, -3)),
    ("slot_mapping", lambda p: _set(p, "slot_mapping", 0, 64 * 16)),
    ("slot_mapping", lambda p: _set(p, "slot_mapping", -1, -1)),
    ("input_ids", lambda p: _set(p, "input_ids", 0, 1000)),
    ("input_ids", lambda p: _set(p, "input_ids", 0, -(2**63))),
    ("cu_seqlens_q", lambda p: _set(p, "cu_seqlens_q", -1, p.cu_seqlens_q[-1] + 1)),
    ("cu_seqlens_q", lambda p: _set(p, "cu_seqlens_q", 1, 0)),
    ("cu_seqlens_q", lambda p: _set(p, "cu_seqlens_q", 1, 2**31 - 1)),
    ("context_lens", lambda p: _set(p, "context_lens", 0, 0)),
    ("context_lens", lambda p: _set(p, "context_lens", 0, 257)),
    ("context_lens", lambda p: _set(p, "context_lens", 0, -(2**31))),
    ("positions", lambda p: _with(p, positions=p.positions[:-1].copy())),
    ("cu_seqlens_q", lambda p: _with(p, cu_seqlens_q=p.cu_seqlens_q[:-1].copy())),
    ("block_tables", lambda p: _with(p, block_tables=p.block_tables[:, :1].copy())),
    ("kind", lambda p: _with(p, kind=7)),
    ("prompt_logits", lambda p: _with(p, prompt_logits=np.ones(p.num_rows + 1, np.bool_))),
    ("block_copies", lambda p: _with(p, block_copies=np.array([[0, 10**6]], np.int32))),
    ("block_copies", lambda p: _with(p, block_copies=np.array([[-1, 0]], np.int32))),
]


@pytest.mark.parametrize("kind", [PREFILL, DECODE])
@pytest.mark.parametrize("field,mutate", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_out_of_limits_plan_names_step_and_field(kind, field, mutate):
    plan = PLANS[kind]
    with pytest.raises(PlanError) as err:
        check_plan(mutate(plan), LIMITS)
    assert err.value.field == field and err.value.step == plan.step_id
    assert f"plan for step {plan.step_id}: {field}" in str(err.value)


@pytest.mark.parametrize("value,field", [
    (["<f8", [3], b"\0" * 24], "input_ids"),        # wrong dtype
    (["<i8", [2, 2], b"\0" * 32], "input_ids"),     # wrong rank
    (["<i8", [5], b"\0" * 8], "input_ids"),         # bytes do not match the shape
    (["|O", [1], b"\0" * 8], "input_ids"),          # objects
    ([1, 2], "input_ids"),
    ("oops", "step_id"),
    (None, "kind"),
])
def test_malformed_fields_are_refused_when_decoding(value, field):
    raw = msgpack.unpackb(PLANS[DECODE].encode(), raw=False)
    raw[field] = value
    with pytest.raises(PlanError, match=field):
        StepPlan.decode(msgpack.packb(raw, use_bin_type=True))


def test_unknown_fields_are_ignored_and_missing_ones_named():
    raw = msgpack.unpackb(PLANS[DECODE].encode(), raw=False)
    raw["some_future_field"] = ["<i8", [1], b"\0" * 8]
    check_plan(StepPlan.decode(msgpack.packb(raw, use_bin_type=True)), LIMITS)
    del raw["slot_mapping"]
    with pytest.raises(PlanError, match="slot_mapping: missing"):
        StepPlan.decode(msgpack.packb(raw, use_bin_type=True))
    for junk in (b"", b"\xc1", msgpack.packb([1, 2]), os.urandom(64)):
        with pytest.raises(PlanError):
            StepPlan.decode(junk)


@pytest.mark.parametrize("kind", [KV_READ, KV_WRITE])
def test_a_plan_that_moves_kv_names_blocks_of_the_pool_and_runs_no_rows(kind):
    plan = roundtrip(StepPlan.moving_kv(kind, 9, [3, 4, 60]))
    check_plan(plan, LIMITS)
    assert (plan.kind, plan.num_rows, plan.num_tokens, plan.kv_blocks.tolist()) == (kind, 0, 0, [3, 4, 60])
    cases = [(StepPlan.moving_kv(kind, 9, [3, 64]), "kv_blocks", "outside"),
             (StepPlan.moving_kv(kind, 9, [-1]), "kv_blocks", "outside"),
             (StepPlan.moving_kv(kind, 9, []), "kv_blocks", "one or more"),
             (_with(plan, input_ids=np.zeros(1, np.int64)), "kind", "no rows"),
             (_with(plan, kv_blocks=None), "kv_blocks", "one or more")]
    if kind == KV_WRITE:
        cases.append((StepPlan.moving_kv(kind, 9, [5, 5]), "kv_blocks", "written twice"))
    for bad, field, text in cases:
        with pytest.raises(PlanError, match=text) as err:
            check_plan(roundtrip(bad), LIMITS)
        assert err.value.field == field and err.value.step == 9


def test_a_step_naming_blocks_to_move_is_refused():
    with pytest.raises(PlanError, match="kv_blocks: only a KV_READ or KV_WRITE"):
        check_plan(_with(PLANS[DECODE], kv_blocks=np.array([1], np.int32)), LIMITS)


@pytest.mark.spawn
@pytest.mark.slow
def test_fuzz_decode_check_and_run(tiny_model_dir):
    """10,000 mutated real plans and random byte strings through decode + check on a real runner, in a child
    process (a crash would be its exit signal): only PlanError; accepted mutants run through the CPU kernels."""
    script = os.path.join(TESTS, "tp_scripts", "fuzz_plans.py")
    proc = subprocess.run([sys.executable, script, tiny_model_dir, "10000", "0"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["unexpected"] == [], result
    assert result["cases"] == 10000 and result["refused"] > 5000 and result["executed"] > 50, result
