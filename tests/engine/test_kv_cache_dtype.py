"""kv_cache_dtype: the engine's greedy tokens equal transformers' with K/V round-tripped through the same 8-bit
format (tests/kv_reference.py: compared up to the reference's first near tie), through chunked prefill, prefix
hits, preemption and n > 1 block copies; the KV budget's block count; bad values refused before anything starts."""
import pytest

from nanovllm_tp import LLM, SamplingParams
from tests.helpers import hf_greedy, mixed_prompts
from tests.kv_reference import LENGTHS, TOKENS, assert_follows, reference

GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
# int8 on the fp32 tiny model: 2 x 4 layers x 16 tokens x 2 heads x (32 + 4) bytes = 9216 bytes a block; 20 blocks
# (and the null block) hold one 300-token sequence and a little more, so the running rows outgrow them
TIGHT = dict(kvcache_block_size=16, max_model_len=300, kv_cache_memory=21 * 9216, max_num_batched_tokens=48)
@pytest.fixture(scope="module")
def prompts(tiny_llm):
    return mixed_prompts(tiny_llm.config.model_config.vocab_size, lengths=LENGTHS)


def assert_all_blocks_free(llm):
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_int8_chunked_prefix_hits_preemption_match_reference(tiny_model_dir, hf_model, prompts):
    runs = reference(tiny_model_dir, "int8", prompts)
    plain = [hf_greedy(hf_model, p, TOKENS) for p in prompts]
    assert any(tokens != p for (tokens, _), p in zip(runs, plain)), "the round trip changes some tokens"
    llm = LLM(tiny_model_dir, kv_cache_dtype="int8", **TIGHT)
    try:
        stats = llm.stats()
        assert stats["kv_cache_dtype"] == "int8" and stats["num_kv_blocks"] == 20
        assert "20 KV blocks of 16 (int8 + fp32 scales)" in llm.engine.runner.describe()
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        bm, sched = llm.engine.scheduler.block_manager, llm.engine.scheduler
        hits = bm.num_prefix_hit_tokens
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert sched.num_preemptions > 0 and sched.num_mixed_steps > 0 and bm.num_prefix_hit_tokens > hits
        assert_all_blocks_free(llm)
    finally:
        llm.close()
    assert_follows(first, runs)
    assert_follows(second, runs)


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_fp8_matches_reference(tiny_model_dir, prompts, kv):
    runs = reference(tiny_model_dir, kv, prompts)
    with LLM(tiny_model_dir, kv_cache_dtype=kv, kvcache_block_size=16, kv_cache_memory=16 << 20) as llm:
        assert llm.stats()["kv_cache_dtype"] == {"fp8": "fp8_e4m3"}.get(kv, kv)
        assert_follows(llm.generate(prompts, GREEDY, use_tqdm=False), runs)


def test_torch_backend_and_sibling_block_copies(tiny_model_dir, prompts):
    """The torch backend's dequantizing reads; n = 2 greedy siblings of prompts ending mid-block, whose last
    block is copied (values and scales) before they part."""
    runs = reference(tiny_model_dir, "int8", prompts)
    with LLM(tiny_model_dir, kv_cache_dtype="int8", attention_backend="torch", kvcache_block_size=16,
             kv_cache_memory=16 << 20) as llm:
        assert_follows(llm.generate(prompts, GREEDY, use_tqdm=False), runs)
        pair = SamplingParams(n=2, temperature=0, max_tokens=TOKENS, ignore_eos=True)
        odd = [i for i, n in enumerate(LENGTHS) if n % 16]
        outs = llm.generate([prompts[i] for i in odd], pair, use_tqdm=False)
        assert_follows([c.token_ids for o in outs for c in o.outputs], [runs[i] for i in odd for _ in range(2)])
        assert_all_blocks_free(llm)


def test_block_count_follows_bytes_per_token(tiny_model_dir, tiny_llm):
    # the shared engine: fp32 KV, 64 MiB; a block there is 2 x 4 x 16 x 2 x 32 x 4 = 32768 bytes (one is the null)
    assert tiny_llm.stats()["num_kv_blocks"] == (64 << 20) // 32768 - 1
    assert tiny_llm.stats()["kv_cache_dtype"] == "float32"
    with LLM(tiny_model_dir, dtype="bfloat16", kvcache_block_size=16, kv_cache_memory=64 << 20) as bf16, \
            LLM(tiny_model_dir, dtype="bfloat16", kv_cache_dtype="fp8_e4m3", kvcache_block_size=16,
                kv_cache_memory=64 << 20) as fp8:
        dense, quantized = bf16.stats()["num_kv_blocks"], fp8.stats()["num_kv_blocks"]
        assert bf16.stats()["kv_cache_dtype"] == "bfloat16"
        assert dense == (64 << 20) // 16384 - 1 and quantized == (64 << 20) // 9216 - 1   # 64 vs 36 bytes a vector
        assert quantized / dense == pytest.approx(64 / 36, rel=1e-3)


@pytest.mark.parametrize("value,exc,pattern", [
    ("int4", ValueError, r"kv_cache_dtype must be one of 'auto', 'int8', 'fp8', 'fp8_e4m3', 'fp8_e5m2', got 'int4'"),
    ("INT8", ValueError, "kv_cache_dtype must be one of"),
    (8, TypeError, "kv_cache_dtype"),
    (None, TypeError, "kv_cache_dtype"),
])
def test_bad_kv_cache_dtype_refused(tiny_model_dir, tiny_llm, value, exc, pattern):
    with pytest.raises(exc, match=pattern):
        LLM(tiny_model_dir, kv_cache_dtype=value)
    assert tiny_llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
