"""The fused decode layers at TP 2 (csrc/decoder.c by half layers, the all-reduces between): greedy tokens against
transformers, with rank 0's decode steps run fused; and the same tokens and logprobs as the modules at TP 2."""
import os

import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.layers import cpu_kernels
from tests.helpers import hf_greedy, mixed_prompts
from tests.procs import segments_of

KV = dict(kvcache_block_size=16, kv_cache_memory=32 << 20)


@pytest.mark.spawn
@pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels do not build here")
def test_tp2_fused_layers_match_transformers_and_the_modules(tiny_model_dir, hf_model):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = mixed_prompts(hf_model.config.vocab_size, lengths=(1, 40, 130), seed=11)
    results = {}
    for on in (True, False):
        llm = LLM(tiny_model_dir, tensor_parallel_size=2, fused_decode=on, **KV)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            fused = llm.engine.runner.model.model.fused
            assert (fused.steps >= params.max_tokens - 1) if on else fused is None
        finally:
            llm.close()
        results[on] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert results[True] == results[False]
    for p, (tokens, _) in zip(prompts, results[True]):
        assert tokens == hf_greedy(hf_model, p, params.max_tokens)
    assert not segments_of(os.getpid())
