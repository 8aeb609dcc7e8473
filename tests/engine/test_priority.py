"""Priority scheduling through the engine (scheduling_policy="priority", vLLM's rule: a lower value runs first):
a high-priority request that arrives while the KV pool is full of lower-priority work gets its first token at
once, where first-come-first-served makes it wait; every request stays equal to transformers' greedy tokens.
And the request-level knob's checks."""
import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.launch.soak import kv_bytes_for
from tests.helpers import hf_greedy, mixed_prompts

LONG, SHORT = 64, 8


def first_token_steps(tiny_model_dir, policy: str, prompts) -> tuple[int, dict, dict]:
    """Three long requests at priority 5 fill a 17-block pool; then one at priority 0 arrives. Returns the steps
    until its first token, every request's tokens, and the engine's stats."""
    with LLM(tiny_model_dir, scheduling_policy=policy, kvcache_block_size=16, max_model_len=256,
             kv_cache_memory=kv_bytes_for(tiny_model_dir, 17, 16, 1)) as llm:
        long = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
        low = [llm.add_request(p, long, priority=5 if policy == "priority" else 0) for p in prompts[:3]]
        tokens = {rid: [] for rid in low}

        def step():
            for out in llm.step():
                tokens.setdefault(out.request_id, [])[:] = out.outputs[0].token_ids
        for _ in range(8):
            step()
        assert llm.stats()["kv_cache_usage"] > 0.85
        late = llm.add_request(prompts[3], SamplingParams(temperature=0, max_tokens=SHORT, ignore_eos=True))
        steps = 0
        while not tokens.get(late):
            step()
            steps += 1
        while llm.has_unfinished_requests():
            step()
        return steps, {i: tokens[rid] for i, rid in enumerate(low + [late])}, llm.stats()


@pytest.mark.slow
def test_a_high_priority_arrival_is_served_at_once_and_everyone_stays_exact(tiny_model_dir, hf_model):
    prompts = mixed_prompts(hf_model.config.vocab_size, lengths=(70, 66, 68, 40), seed=5)
    steps, got, stats = first_token_steps(tiny_model_dir, "priority", prompts)
    assert steps <= 2 and stats["num_preemptions"] >= 1
    steps_fcfs, got_fcfs, _ = first_token_steps(tiny_model_dir, "fcfs", prompts)
    assert steps_fcfs > 10 * steps
    for i, p in enumerate(prompts):
        want = hf_greedy(hf_model, p, SHORT if i == 3 else LONG)
        assert got[i] == want and got_fcfs[i] == want


def test_priority_is_checked_before_the_engine(tiny_llm, tiny_model_dir):
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        tiny_llm.add_request([1, 2, 3], priority=1)
    with pytest.raises(ValueError, match="one per prompt"):
        tiny_llm.generate([[1, 2], [3, 4]], priority=[0])
    with pytest.raises(TypeError, match="priority must be an int"):
        tiny_llm.generate([[1, 2]], priority=[True])
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(tiny_model_dir, scheduling_policy="lottery")
    assert not tiny_llm.has_unfinished_requests()
    assert tiny_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_equal_priorities_start_and_finish_in_arrival_order(tiny_model_dir):
    """One sequence at a time: the requests of each priority start and finish in the order they arrived (lower
    priority values first), none preempting another of its own priority."""
    prios = [3, 3, 1, 3, 1, 3, 3, 1, 3]
    with LLM(tiny_model_dir, scheduling_policy="priority", max_num_seqs=1, kvcache_block_size=16,
             kv_cache_memory=16 << 20, max_model_len=128) as llm:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        rids = [llm.add_request([10 + i, 20, 30, 40], params, priority=p) for i, p in enumerate(prios)]
        started, finished, late = [], [], False
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.request_id not in started:
                    started.append(out.request_id)
                if out.finished:
                    finished.append(out.request_id)
            if len(started) == 2 and not late:     # late arrivals of both priorities join while the first run
                late = True
                rids += [llm.add_request([90 + p, 91, 92], params, priority=p) for p in (3, 1, 3)]
                prios += [3, 1, 3]
        assert llm.stats()["num_preemptions"] == 0
    by_priority = [r for p in sorted(set(prios)) for r, q in zip(rids, prios) if q == p]
    # the first two started before the late ones arrived; after them, every request in priority-then-arrival order
    rest = [r for r in by_priority if r not in started[:2]]
    assert started == started[:2] + rest and finished == started
    assert started[:2] == [rids[2], rids[4]]
