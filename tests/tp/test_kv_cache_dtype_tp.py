"""kv_cache_dtype at TP 2: each rank quantizes its own KV head; greedy tokens follow transformers with K/V
round-tripped through int8 (tests/kv_reference.py), through chunked prefill, prefix hits and preemption."""
import os

import pytest

from nanovllm_tp import LLM, SamplingParams
from tests.helpers import mixed_prompts
from tests.kv_reference import LENGTHS, TOKENS, assert_follows, reference
from tests.procs import segments_of


@pytest.mark.spawn
def test_tp2_int8_chunked_prefix_preemption_match_reference(tiny_model_dir, tiny_llm):
    prompts = mixed_prompts(tiny_llm.config.model_config.vocab_size, lengths=LENGTHS)
    runs = reference(tiny_model_dir, "int8", prompts)
    # one KV head per rank: 2 x 4 layers x 16 tokens x (32 + 4) bytes = 4608 bytes a block; 20 blocks and the null
    knobs = dict(kvcache_block_size=16, max_model_len=300, kv_cache_memory=21 * 4608, max_num_batched_tokens=48)
    greedy = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, kv_cache_dtype="int8", **knobs)
    try:
        assert llm.stats()["num_kv_blocks"] == 20 and llm.stats()["kv_cache_dtype"] == "int8"
        first = llm.generate(prompts, greedy, use_tqdm=False)
        sched = llm.engine.scheduler
        hits = sched.block_manager.num_prefix_hit_tokens
        second = llm.generate(prompts, greedy, use_tqdm=False)
        assert sched.num_preemptions > 0 and sched.num_mixed_steps > 0
        assert sched.block_manager.num_prefix_hit_tokens > hits
        assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
        children = llm.engine.children
    finally:
        llm.close()
    assert all(c.poll() is not None for c in children)
    assert not segments_of(os.getpid())
    assert_follows(first, runs)
    assert_follows(second, runs)
