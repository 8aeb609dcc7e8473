"""The fused decode layers at TP 2 (csrc/decoder.c by half layers, the all-reduces between): greedy tokens against
transformers, with rank 0's decode steps run fused; and the same tokens and logprobs as the modules at TP 2, LoRA
rows (their deltas sliced as their base layers, the row-parallel ones reduced with them) beside base rows; with
an int8 / fp8 KV cache; and with oneDNN-packed linears run between decoder.c's calls (LoRA rows, bf16)."""
import os

import pytest

from nanovllm_tp import LLM, LoRARequest, SamplingParams
from nanovllm_tp.config.engine_config import ModelConfig
from nanovllm_tp.layers import cpu_kernels
from tests.helpers import hf_greedy, mixed_prompts
from tests.procs import segments_of

pytestmark = pytest.mark.kernel_paths     # run again by .ci/run under --packed-linear c+onednn

KV = dict(kvcache_block_size=16, kv_cache_memory=32 << 20)


@pytest.mark.spawn
@pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels do not build here")
def test_tp2_fused_layers_match_transformers_and_the_modules(tiny_model_dir, tmp_path):
    pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    import torch
    from transformers import AutoModelForCausalLM
    from nanovllm_tp.launch.make_lora import make_lora
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    loras = [None, LoRARequest("l1", 1, make_lora(hf, tmp_path / "l1", rank=16, alpha=32, seed=1)), None,
             LoRARequest("l2", 2, make_lora(hf, tmp_path / "l2", rank=8, alpha=16, seed=2))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = mixed_prompts(hf.config.vocab_size, lengths=(1, 40, 130, 9), seed=11)
    results = {}
    for on in (True, False):
        llm = LLM(tiny_model_dir, tensor_parallel_size=2, fused_decode=on, enable_lora=True, max_lora_rank=16, **KV)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            fused = llm.engine.runner.model.model.fused
            assert (fused.lora_steps >= params.max_tokens - 1) if on else fused is None
        finally:
            llm.close()
        results[on] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert results[True] == results[False]
    for p, (tokens, _), lora in zip(prompts, results[True], loras):
        if lora is None:
            assert tokens == hf_greedy(hf, p, params.max_tokens)
        else:    # the adapters change the tokens (peft's own check: tests/engine/test_lora.py)
            assert tokens != hf_greedy(hf, p, params.max_tokens)
    assert not segments_of(os.getpid())


@pytest.mark.spawn
@pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels do not build here")
@pytest.mark.parametrize("kv,knobs", [("int8", {}), ("fp8_e4m3", {"dtype": "bfloat16", "packed_linear": "c"}),
                                      ("fp8_e5m2", {})])
def test_tp2_fused_layers_with_a_quantized_kv_cache_are_the_modules(tiny_model_dir, kv, knobs):
    """An 8-bit KV cache at TP 2 (each rank its KV heads' values and scales, stored and read inside decoder.c):
    the same tokens and logprobs as the modules, with every decode step run fused."""
    import torch
    if knobs.get("dtype") == "bfloat16" and torch.bfloat16 not in cpu_kernels.load().linear_dtypes:
        pytest.skip("bf16 layers fuse through csrc/linear.c's bf16 kernel (AVX-512 BF16)")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = mixed_prompts(ModelConfig.from_pretrained(tiny_model_dir).vocab_size, lengths=(1, 40, 130, 9), seed=17)
    results = {}
    for on in (True, False):
        with LLM(tiny_model_dir, tensor_parallel_size=2, fused_decode=on, kv_cache_dtype=kv, **knobs,
                 **KV) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            fused = llm.engine.runner.model.model.fused
            assert (fused.steps >= params.max_tokens - 1) if on else fused is None
        results[on] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert results[True] == results[False]
    assert not segments_of(os.getpid())


@pytest.mark.spawn
@pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels do not build here")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_fused_layers_with_onednn_linears_are_the_modules(tiny_model_dir, tmp_path, dtype):
    """packed_linear=onednn at TP 2: each rank's linears run through oneDNN between decoder.c's calls, the
    all-reduces after o and down (with their LoRA deltas added before), in steps of several row-count buckets: the
    same tokens and logprobs as the modules at TP 2, and (fp32) the base rows' greedy tokens transformers'."""
    pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    import torch
    from transformers import AutoModelForCausalLM
    from nanovllm_tp.launch.make_lora import make_lora
    from nanovllm_tp.layers.packed_linear import ONEDNN
    if not ONEDNN.can_run(torch.zeros(1, 2, dtype=getattr(torch, dtype))):
        pytest.skip("oneDNN does not pack weights of this dtype here")
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    lora = LoRARequest("l1", 1, make_lora(hf, tmp_path / "l1", rank=8, alpha=16, seed=3))
    lengths, max_tokens = (1, 40, 130, 9, 3, 20, 7, 64, 12, 33), (14, 3, 3, 6, 6, 6, 9, 9, 11, 3)
    loras = [None, lora, None, None, lora, None, lora, None, None, lora]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in max_tokens]
    prompts = mixed_prompts(hf.config.vocab_size, lengths=lengths, seed=23)
    results = {}
    for on in (True, False):
        with LLM(tiny_model_dir, tensor_parallel_size=2, fused_decode=on, packed_linear="onednn", dtype=dtype,
                 enable_lora=True, max_lora_rank=8, **KV) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            fused = llm.engine.runner.model.model.fused
            if on:
                assert fused.caller_steps == fused.steps >= max(max_tokens) - 1 and fused.lora_steps > 0
                assert len({key[3] for key in fused.tables}) >= 3       # buckets 9-16, 5-8, 2-4, 1
            else:
                assert fused is None
        results[on] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert results[True] == results[False]
    if dtype == "float32":
        for p, n, (tokens, _), row_lora in zip(prompts, max_tokens, results[True], loras):
            if row_lora is None:
                assert tokens == hf_greedy(hf, p, n)
    assert not segments_of(os.getpid())
