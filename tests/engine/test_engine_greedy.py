"""The engine's greedy tokens equal transformers' token for token (fp32, CPU), in every scheduling regime."""
import pytest

from nanovllm_tp import LLM, SamplingParams
from tests.helpers import hf_greedy, mixed_prompts, shared_prefix_prompts

pytestmark = pytest.mark.kernel_paths     # run again by .ci/run under --packed-linear c+onednn

NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def token_lists(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def prompts(tiny_llm):
    return mixed_prompts(tiny_llm.config.model_config.vocab_size)


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    return [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def baseline(tiny_llm, prompts):
    return token_lists(tiny_llm.generate(prompts, GREEDY, use_tqdm=False))


def assert_all_blocks_free(llm):
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_greedy_matches_transformers(tiny_llm, prompts, baseline, reference):
    assert len(prompts) >= 8 and max(map(len, prompts)) >= 256
    for i, (got, want) in enumerate(zip(baseline, reference)):
        assert got == want, f"prompt {i} (len {len(prompts[i])}) diverges at token " \
                            f"{next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)}"
    assert_all_blocks_free(tiny_llm)


def test_outputs_in_input_order_with_text(tiny_llm):
    outs = tiny_llm.generate(["hello world", "the quick brown fox"], SamplingParams(temperature=0, max_tokens=8))
    assert [o.prompt for o in outs] == ["hello world", "the quick brown fox"]
    tok = tiny_llm.get_tokenizer()
    for o in outs:
        assert o.prompt_token_ids == tok.encode(o.prompt)
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
        assert o.outputs[0].finish_reason in ("stop", "length")


def test_chunked_prefill_matches_unchunked(tiny_model_dir, prompts, baseline):
    llm = LLM(tiny_model_dir, kvcache_block_size=16, kv_cache_memory=64 << 20, max_num_batched_tokens=48)
    assert token_lists(llm.generate(prompts, GREEDY, use_tqdm=False)) == baseline
    assert llm.engine.scheduler.num_mixed_steps > 0, "prompt chunks ran next to decoding rows"
    assert_all_blocks_free(llm)


def test_prefix_cache_hits_give_same_tokens(tiny_model_dir, tiny_llm, hf_model):
    vocab = tiny_llm.config.model_config.vocab_size
    first = shared_prefix_prompts(vocab, prefix_len=200, seed=1)
    second = shared_prefix_prompts(vocab, prefix_len=200, tails=(3, 30, 64), seed=1)
    llm = LLM(tiny_model_dir, kvcache_block_size=16, kv_cache_memory=64 << 20)
    bm = llm.engine.scheduler.block_manager
    llm.generate(first, GREEDY, use_tqdm=False)
    hits_before = bm.num_prefix_hit_tokens
    warm = token_lists(llm.generate(second, GREEDY, use_tqdm=False))
    # every prompt of the second round shares the 200-token prefix: 12 full blocks of 16 each
    assert bm.num_prefix_hit_tokens - hits_before >= len(second) * 12 * 16
    cold = LLM(tiny_model_dir, kvcache_block_size=16, kv_cache_memory=64 << 20, enable_prefix_caching=False)
    assert warm == token_lists(cold.generate(second, GREEDY, use_tqdm=False))
    assert warm[0] == hf_greedy(hf_model, second[0], NEW_TOKENS)
    assert_all_blocks_free(llm)


def test_fully_cached_block_aligned_prompt(tiny_model_dir, hf_model):
    llm = LLM(tiny_model_dir, kvcache_block_size=16, kv_cache_memory=64 << 20)
    prompt = mixed_prompts(llm.config.model_config.vocab_size, lengths=(64,), seed=5)[0]
    first = token_lists(llm.generate([prompt], GREEDY, use_tqdm=False))[0]
    bm = llm.engine.scheduler.block_manager
    hits = bm.num_prefix_hit_tokens
    again = token_lists(llm.generate([prompt], GREEDY, use_tqdm=False))[0]
    assert bm.num_prefix_hit_tokens - hits == 48     # 3 of 4 blocks: the last token is always recomputed
    assert first == again == hf_greedy(hf_model, prompt, NEW_TOKENS)


def test_preemption_matches_unconstrained(tiny_model_dir, prompts, baseline):
    # max_model_len 400 needs 25 blocks; a 40-block pool holds only a few of the 9 requests at once
    llm = LLM(tiny_model_dir, kvcache_block_size=16, max_model_len=400, kv_cache_memory=41 * 32768)
    sched = llm.engine.scheduler
    assert sched.block_manager.num_blocks == 40
    assert token_lists(llm.generate(prompts, GREEDY, use_tqdm=False)) == baseline
    assert sched.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_step_api_serves_requests_as_they_come(tiny_llm, prompts, baseline):
    first = tiny_llm.add_request(prompts[0], GREEDY)
    done = {}
    for _ in range(3):
        for out in tiny_llm.step():
            done[out.request_id] = out
    mixed_before = tiny_llm.engine.scheduler.num_mixed_steps
    second = tiny_llm.add_request(prompts[1], GREEDY)      # joins while the first is decoding: a mixed step
    while tiny_llm.has_unfinished_requests():
        for out in tiny_llm.step():
            done[out.request_id] = out
    assert done[first].outputs[0].token_ids == baseline[0]
    assert done[second].outputs[0].token_ids == baseline[1]
    assert tiny_llm.engine.scheduler.num_mixed_steps == mixed_before + 1
    m = done[first].metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time
