"""kv_cache_dtype on CUDA: the Triton backend (and flash-attn, when installed) read a quantized cache through
per-step dequantized copies of its blocks; greedy tokens follow transformers with K/V round-tripped the same way
(tests/kv_reference.py), on the device, fp32. Skipped without CUDA."""
import pytest
import torch

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.layers.attention.flash import flash_available
from tests.helpers import mixed_prompts
from tests.kv_reference import LENGTHS, TOKENS, assert_follows, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_torch_cuda_backend_follows_reference(tiny_model_dir, kv, release):
    llm = LLM(tiny_model_dir, device="cuda", dtype="float32", kv_cache_dtype=kv, attention_backend="torch-cuda",
              kvcache_block_size=16, kv_cache_memory=64 << 20, max_num_batched_tokens=48)
    try:
        assert llm.stats()["cuda_graph_batch_sizes"] is None       # eager: the dequantized copies are per step
        prompts = mixed_prompts(llm.config.model_config.vocab_size, lengths=LENGTHS)
        greedy = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
        first = llm.generate(prompts, greedy, use_tqdm=False)
        second = llm.generate(prompts, greedy, use_tqdm=False)       # prefix hits
    finally:
        release(llm)
    runs = reference(tiny_model_dir, kv, prompts)
    assert_follows(first, runs)
    assert_follows(second, runs)


@pytest.mark.skipif(not flash_available(), reason="flash-attn is not installed")
def test_flash_backend_takes_an_int8_cache(tiny_model_dir, release):
    llm = LLM(tiny_model_dir, device="cuda", dtype="bfloat16", kv_cache_dtype="int8", attention_backend="flash",
              kv_cache_memory=64 << 20)
    try:
        out = llm.generate([[5, 6, 7] * 100], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 16 and llm.stats()["kv_cache_dtype"] == "int8"
    finally:
        release(llm)
