"""batch_invariant=True: a request's tokens and logprobs, to the bit, do not depend on what else the engine runs.
The same request cold, on a prefix-cache hit, in the middle of 15 other requests, with its prompt chunked, under
n-gram speculation and after preemptions: greedy on SmolLM2 in bf16 and on the tiny checkpoint in fp32 and bf16,
and seeded sampling. Without the knob, the hit, the batch and the chunked prompt already change SmolLM2's
logprobs on this project's CPUs (SDPA's blocking follows the prompt's length; oneDNN's, the row count)."""
import random

import pytest

from nanovllm_tp import LLM, SamplingParams
from tests.helpers import GGUF, smollm2

pytestmark = pytest.mark.slow
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SITUATIONS = {                       # name -> (engine knobs, whether the request runs among the 15 others)
    "chunked prefill": ({"max_num_batched_tokens": 48}, False),
    "n-gram speculation, in a batch": ({"speculative_config": NGRAM}, True),
    "preempted, in a batch": ({}, True),      # 40 blocks: the request's 22 and a few of the others'
}
PREEMPTING_BLOCKS = 40


def workload(vocab: int, seed: int = 0):
    """A 300-token prompt (with copies inside, so that n-gram proposals get accepted) and 15 others."""
    rng = random.Random(seed)
    head = [rng.randrange(100, vocab) for _ in range(120)]
    prompt = head + head[:60] + [rng.randrange(100, vocab) for _ in range(60)] + head[30:90]
    others = [[rng.randrange(100, vocab) for _ in range(rng.randrange(20, 200))] for _ in range(15)]
    return prompt, others


def completions(model: str, params: SamplingParams, vocab: int, **knobs) -> dict:
    """The request's completion in every situation, by name."""
    prompt, others = workload(vocab)
    batch = others + [prompt]                       # last: the first to be preempted when blocks run out
    base = {"max_model_len": 512, "kv_cache_memory": 256 << 20, "batch_invariant": True, **knobs}
    out = {}
    llm = LLM(model, **base)
    try:
        out["cold"] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        out["prefix hit"] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        out["in a batch of 16"] = llm.generate(batch, params, use_tqdm=False)[-1].outputs[0]
        block_bytes = llm.engine.runner.kv_block_bytes()
    finally:
        llm.close()
    for name, (extra, batched) in SITUATIONS.items():
        if name.startswith("preempted"):
            extra = {"kv_cache_memory": PREEMPTING_BLOCKS * block_bytes}
        llm = LLM(model, **{**base, **extra})
        try:
            out[name] = llm.generate(batch if batched else [prompt], params, use_tqdm=False)[-1].outputs[0]
            if name.startswith("preempted"):
                assert llm.stats()["num_preemptions"] > 0
        finally:
            llm.close()
    return out


def assert_identical(out: dict) -> None:
    cold = out["cold"]
    want = [{t: lp.logprob for t, lp in step.items()} for step in cold.logprobs]
    for name, got in out.items():
        assert got.token_ids == cold.token_ids, name
        assert [{t: lp.logprob for t, lp in step.items()} for step in got.logprobs] == want, name


@smollm2
def test_smollm2_bf16_greedy_is_the_same_whatever_else_runs():
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    assert_identical(completions(GGUF, params, 49152, quantization="none", dtype="bfloat16"))


@smollm2
def test_smollm2_gguf_blocks_greedy_is_the_same_whatever_else_runs():
    """The Q4_1 blocks kept (csrc/linear_q.c quantizes each row's activations on its own)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    assert_identical(completions(GGUF, params, 49152, dtype="bfloat16"))


@smollm2
def test_smollm2_bf16_seeded_sampling_is_the_same_whatever_else_runs():
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=40, ignore_eos=True, logprobs=1)
    assert_identical(completions(GGUF, params, 49152, quantization="none", dtype="bfloat16"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_greedy_is_the_same_whatever_else_runs(tiny_model_dir, dtype):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    assert_identical(completions(tiny_model_dir, params, 1000, dtype=dtype, max_num_seqs=16))


def test_batch_invariant_refuses_the_knobs_that_take_another_path(tiny_model_dir):
    for knobs, named in (({"packed_linear": "onednn"}, "packed_linear='onednn'"),
                         ({"attention_backend": "torch"}, "attention_backend='torch'"),
                         ({"cpu_kernels": False}, "cpu_kernels=False"),
                         ({"kv_cache_dtype": "int8"}, "kv_cache_dtype='int8'")):
        with pytest.raises(ValueError, match=f"batch_invariant needs .*{named}"):
            LLM(tiny_model_dir, batch_invariant=True, **knobs)
    llm = LLM(tiny_model_dir, batch_invariant=True)
    try:
        assert llm.config.packed_linear == "c" and llm.config.attention_backend == "cpu"
    finally:
        llm.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_a_prompt_past_512_tokens_is_the_same_cold_on_a_hit_chunked_and_in_company(tiny_model_dir, dtype):
    """A 700-token prompt: past 512 tokens the cpu backend's default path is SDPA's blocked prefill, so the knob
    must force every prompt token through the decode kernel there too (the prompts above stay below 512, where
    that path is taken anyway). Cold, on a prefix hit (12 tokens over 688 cached: decode rows), chunked (chunks
    of 256 over cached KV) and in a step with three other prompts: the same tokens and logprobs. Without the
    forcing (platform.py's every_row_as_decode), the hit and the chunked prompt give other logprobs in both
    dtypes; in company the prompt's row would go through SDPA as it does cold, so that case holds the linear
    layers' side."""
    rng = random.Random(7)
    prompt = [rng.randrange(100, 1000) for _ in range(700)]
    others = [[rng.randrange(100, 1000) for _ in range(n)] for n in (90, 600, 30)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    base = {"max_model_len": 1024, "kv_cache_memory": 64 << 20, "batch_invariant": True, "dtype": dtype}
    out = {}
    with LLM(tiny_model_dir, **base) as llm:
        out["cold"] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        out["prefix hit"] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    with LLM(tiny_model_dir, **base, max_num_batched_tokens=256) as llm:
        out["chunked"] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    with LLM(tiny_model_dir, **base) as llm:
        out["in company"] = llm.generate(others + [prompt], params, use_tqdm=False)[-1].outputs[0]
        assert llm.stats()["num_preemptions"] == 0
    assert_identical(out)


def test_a_cpu_without_the_row_independent_kernel_is_told_at_load(tiny_model_dir, caplog):
    """Where csrc/linear.c cannot run the weights (no AVX-512), the knob cannot hold what it promises: a warning
    at load says so; where it runs them, no warning."""
    import logging

    import torch

    from nanovllm_tp.layers import cpu_kernels
    kernels = cpu_kernels.load()
    c_runs = kernels is not None and torch.float32 in kernels.linear_dtypes
    with caplog.at_level(logging.WARNING, logger="nanovllm_tp"):
        llm = LLM(tiny_model_dir, batch_invariant=True, kvcache_block_size=16, kv_cache_memory=16 << 20)
        llm.close()
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("batch_invariant:")]
    assert bool(warned) == (not c_runs), warned
    if warned:
        assert "AVX-512 F" in warned[0] and "float32" in warned[0]
