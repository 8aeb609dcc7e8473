"""Fuzz a worker's plan intake: mutated real plans and random byte strings through StepPlan.decode and
check_plan, on a real TP=1 runner; plans that pass after a mutation also run through the model. Prints one
JSON line; any exception other than PlanError (or a crash, seen by the caller as the exit signal) is a finding.

usage: fuzz_plans.py MODEL_DIR CASES SEED
"""
import json
import random
import sys
import traceback

import msgpack
import numpy as np

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.scheduler.plan import ARRAY_SPECS, PlanError, StepPlan
from nanovllm_tp.workers.plan_check import PlanLimits, check_plan

MAX_EXECUTED = 60
model, cases, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
llm = LLM(model, kvcache_block_size=16, kv_cache_memory=16 << 20, max_model_len=512)
engine = llm.engine
captured = []
schedule = engine.scheduler.schedule


def capture():
    step = schedule()
    if step is not None:
        captured.append(step.plan.encode())
    return step


engine.scheduler.schedule = capture
vocab = llm.config.model_config.vocab_size
prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 17, 40, 90)]
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
runner, limits = engine.runner, PlanLimits.of(engine.runner)
check_plan(StepPlan.decode(captured[0]), limits)

EDGE = [-1, -2, 0, 1, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63), limits.num_blocks, limits.num_blocks - 1,
        limits.max_model_len, limits.max_model_len - 1, vocab, vocab - 1, limits.num_blocks * limits.block_size]


def mutate_field(raw: dict) -> str:
    name = rng.choice(sorted(raw))
    value = raw[name]
    how = rng.randrange(8)
    try:
        arr = np.frombuffer(value[2], dtype=np.dtype(value[0])).copy()
    except Exception:                                       # not (or no longer) an encoded array
        arr = None
    if arr is not None and arr.dtype.kind not in "biuf":
        arr = None
    if arr is not None and how < 5:                         # change one element of an array
        if arr.size:
            info = np.iinfo(arr.dtype) if arr.dtype.kind in "iu" else None
            new = rng.choice(EDGE) if rng.random() < 0.7 else rng.randrange(-5000, 5000)
            if info is not None:
                new = min(max(new, info.min), info.max)
            arr.reshape(-1)[rng.randrange(arr.size)] = new
        value[2] = arr.tobytes()
    elif arr is not None and how == 5:                      # lie about dtype or shape
        value[rng.randrange(2)] = rng.choice(["<i4", "<i8", "<f4", "|O", "V8", "<U3", [1], [2, 2], [-1], [10**12]])
    elif how == 6:                                          # a wrong type, or nothing
        raw[name] = rng.choice([None, "x", 1.5, [1, 2, 3], {"a": 1}, b"\0" * 8, -1, 2**40])
    else:
        del raw[name]
    return name


counts = {"cases": 0, "refused": 0, "accepted": 0, "executed": 0, "unexpected": []}
for i in range(cases):
    counts["cases"] += 1
    base = rng.choice(captured)
    r = rng.random()
    mutated_struct = False
    if r < 0.2:
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
    elif r < 0.45:
        data = bytearray(base)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        data = bytes(data[:rng.randrange(len(data) + 1)] if rng.random() < 0.2 else data)
    else:
        raw = msgpack.unpackb(base, raw=False)
        for _ in range(rng.randint(1, 2)):
            if raw:
                mutate_field(raw)
        if rng.random() < 0.1:
            raw["unknown_" + str(i)] = ["<i8", [1], b"\0" * 8]
        data, mutated_struct = msgpack.packb(raw, use_bin_type=True), True
    try:
        plan = StepPlan.decode(data)
        check_plan(plan, limits)
    except PlanError:
        counts["refused"] += 1
        continue
    except Exception:
        counts["unexpected"].append(traceback.format_exc()[-600:])
        continue
    counts["accepted"] += 1
    if mutated_struct and counts["executed"] < MAX_EXECUTED:
        try:
            runner.execute(plan)
        except Exception:
            counts["unexpected"].append("accepted plan failed in the runner: " + traceback.format_exc()[-600:])
        counts["executed"] += 1
    if len(counts["unexpected"]) > 20:
        break
llm.close()
counts["array_fields"] = sorted(ARRAY_SPECS)
print(json.dumps(counts))
