"""The scheduler's figures the engine loop sends with every step come from LLM.counters(): the same values as
LLM.stats() gives under those keys, without stats()' walk over the model's modules."""
from nanovllm_tp import SamplingParams
from nanovllm_tp.serving.engine_loop import scheduler_stats

KEYS = ("num_running", "num_waiting", "kv_cache_usage", "num_kv_blocks", "num_preemptions", "num_draft_tokens",
        "num_accepted_tokens", "num_accepted_tokens_per_pos", "prefix_cache_hit_tokens",
        "prefix_cache_query_tokens", "kv_transfer")


def test_counters_are_stats_figures_while_requests_run(tiny_llm):
    llm = tiny_llm
    shared = list(range(1, 40))              # two blocks of 16 the second request finds in the prefix cache
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    llm.add_request(shared + [50], params)
    llm.step()
    llm.add_request(shared + [60], params)
    llm.add_request([7, 8, 9], params)
    seen_running = set()
    while llm.has_unfinished_requests():
        counters, stats = llm.counters(), llm.stats()
        assert set(counters) == set(KEYS)
        assert counters == {k: stats[k] for k in KEYS}
        seen_running.add(counters["num_running"])
        llm.step()
    assert llm.counters() == {k: llm.stats()[k] for k in KEYS}
    assert max(seen_running) >= 2 and llm.counters()["prefix_cache_hit_tokens"] > 0


def test_the_engine_loops_figures_do_not_call_stats(tiny_llm):
    """stats() walks every module of the model (linear paths, kernel choices): a millisecond a step on SmolLM2."""
    llm = tiny_llm
    expected = scheduler_stats(llm)

    def refused():
        raise AssertionError("the engine loop's per-step figures called LLM.stats()")

    llm.stats = refused
    try:
        assert scheduler_stats(llm) == expected
    finally:
        del llm.stats
    assert expected["kv_blocks"] == llm.stats()["num_kv_blocks"] > 0
