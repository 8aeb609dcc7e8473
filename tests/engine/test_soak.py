"""The randomized lifecycle soak (launch/soak.py): random mixes of n, stop strings, stop ids, min_tokens, penalties,
seeds, logprobs and output kinds, arrivals while others run (step()-driven and through generate()), aborts at
random steps, a KV pool that preempts often, chunked prompts and shared prefixes; every request equals itself run
alone on a TP 1 engine without prefix caching, aborted ones are prefixes of it, no block is left held.
The quick forms run in the suite; the long ones (1,000 requests) with -m long."""
import random

import pytest

from nanovllm_tp import LLM
from nanovllm_tp.launch.soak import kv_bytes_for, make_requests, soak, stop_strings_of


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(tiny_model_dir, kvcache_block_size=16, enable_prefix_caching=False, kv_cache_memory=64 << 20)
    yield llm
    llm.close()


def run_soak(tiny_model_dir, reference, tp: int, count: int, seed: int):
    rng = random.Random(seed)
    tok = reference.get_tokenizer()
    requests = make_requests(rng, tok.vocab_size, count, stop_strings_of(tok, tok.vocab_size, rng))
    with LLM(tiny_model_dir, tensor_parallel_size=tp, kvcache_block_size=16, max_num_batched_tokens=96,
             max_model_len=256, kv_cache_memory=kv_bytes_for(tiny_model_dir, 17, 16, tp)) as llm:
        assert llm.stats()["num_kv_blocks"] == 17
        result = soak(llm, reference, requests, seed)
    assert not result.mismatches, "\n".join(result.mismatches[:10])
    assert result.leaked_blocks == 0
    assert result.aborted > 0 and result.prefix_hit_tokens > 0
    return result


def test_quick_soak_tp1(tiny_model_dir, reference):
    r = run_soak(tiny_model_dir, reference, 1, 150, seed=1)
    assert r.preemptions >= 10, r


@pytest.mark.spawn
@pytest.mark.slow
def test_quick_soak_tp2(tiny_model_dir, reference):
    r = run_soak(tiny_model_dir, reference, 2, 150, seed=2)
    assert r.preemptions >= 10, r


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.spawn)])
def test_long_soak(tiny_model_dir, reference, tp):
    r = run_soak(tiny_model_dir, reference, tp, 1000, seed=10 + tp)
    assert r.preemptions >= 200, r
