"""What lands in the paged KV cache: blocks filled by decode steps are reused only once their KV exists, and
padding rows (as in a CUDA-graph decode) write into the null block, never into a block a sequence holds."""
import pytest
import torch

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.utils.context import reset_context, set_context
from nanovllm_tp.workers.cuda_graph import DecodeInputs
from tests.helpers import hf_greedy, mixed_prompts, written_slots

pytestmark = pytest.mark.kernel_paths     # run again by .ci/run under --packed-linear c+onednn

BS16_BLOCK_BYTES = 32 << 10     # the tiny model at TP=1: 2 (K, V) * 4 layers * 16 slots * 2 kv heads * 32 * 4 B


def test_follow_up_over_decode_filled_blocks_matches_transformers(tiny_model_dir, hf_model):
    # Block size 2: each request's last sampled token completes a block but is never computed. A follow-up
    # (prompt + completion + more) hits every block before it, filled by decode steps, and must recompute that
    # one: were it published with the sampled token, the follow-up would read a slot nothing wrote.
    llm = LLM(tiny_model_dir, kvcache_block_size=2, kv_cache_memory=4 << 20, max_model_len=256)
    try:
        prompts = mixed_prompts(llm.config.model_config.vocab_size, lengths=(5, 8, 13, 20, 3, 10), seed=5)
        params = [SamplingParams(temperature=0, max_tokens=8 - len(p) % 2, ignore_eos=True) for p in prompts]
        first = llm.generate(prompts, params, use_tqdm=False)
        follow = [p + o.outputs[0].token_ids + [11, 12, 13] for p, o in zip(prompts, first)]
        assert all(len(p) + sp.max_tokens == len(f) - 3 and (len(f) - 3) % 2 == 0
                   for p, sp, f in zip(prompts, params, follow))
        bm = llm.engine.scheduler.block_manager
        hits = bm.num_prefix_hit_tokens
        second = llm.generate(follow, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        for f, out in zip(follow, second):
            assert out.outputs[0].token_ids == hf_greedy(hf_model, f, 6)
        # every full block but the last completion block is a hit (the prompt's own blocks and decode-filled ones)
        assert bm.num_prefix_hit_tokens - hits == sum(len(f) - 3 - 2 for f in follow)
    finally:
        llm.close()


@pytest.fixture
def eight_block_llm(tiny_model_dir):
    llm = LLM(tiny_model_dir, kvcache_block_size=16, kv_cache_memory=9 * BS16_BLOCK_BYTES, max_model_len=128)
    yield llm
    llm.close()


def test_null_block_is_one_past_the_last_usable_block(eight_block_llm):
    runner = eight_block_llm.engine.runner
    assert runner.kv_block_bytes() == BS16_BLOCK_BYTES
    assert runner.num_kv_blocks == eight_block_llm.engine.scheduler.block_manager.num_blocks == 8
    assert runner.k_cache.shape[1] == runner.v_cache.shape[1] == 9       # 8 usable blocks + the null block
    assert runner.null_slot == 8 * 16


def test_padding_rows_leave_a_live_sequences_kv_unchanged(eight_block_llm):
    llm, runner = eight_block_llm, eight_block_llm.engine.runner
    sched = llm.engine.scheduler
    llm.add_request(list(range(1, 121)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.step()                                          # the prefill: 120 tokens in blocks 0..7
    (seq,) = sched.running
    assert seq.block_table == list(range(8))           # it holds the last usable block
    plan = sched.schedule().plan                             # its next decode: position 120, block 7
    assert plan.num_rows == 1 and int(plan.slot_mapping[0]) == 7 * 16 + 8
    k_before, v_before = runner.k_cache.clone(), runner.v_cache.clone()
    # The decode as a CUDA graph of 4 rows runs it: the same inputs, padded by DecodeInputs, run eagerly here.
    inputs = DecodeInputs(max_rows=4, width=8, device=runner.device)
    inputs.fill(plan, rows=4, null_slot=runner.null_slot)
    set_context(inputs.context(4))
    try:
        with torch.inference_mode():
            runner.model(inputs.device["input_ids"][:4], inputs.device["positions"][:4])
    finally:
        reset_context()
    sched.postprocess([0])
    # the real row's slot and the null block's first slot (one past the last usable block), nothing else
    assert written_slots(k_before, runner.k_cache) == written_slots(v_before, runner.v_cache) == {7 * 16 + 8, 8 * 16}
