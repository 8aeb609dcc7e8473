"""quantization="int8": a dense checkpoint's linear layers and LM head quantized at load to int8 per output channel
(as vLLM's W8A8 on CPU), activations quantized per block of 128 inputs. The engine's greedy tokens against
transformers with the same int8 weights and inputs rounded per block (tests/quant_reference.py), TP 1 and 2,
through csrc/linear_q.c and through the torch reference; the embedding stays dense."""
import os

import pytest
import torch

from nanovllm_tp.launch.make_tiny import CORPUS
from nanovllm_tp.launch.perplexity import main
from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.quant import INT8
from tests.helpers import GGUF, smollm2
from tests.quant_reference import assert_follows_reference, int8_reference

pytestmark = pytest.mark.kernel_paths     # run again by .ci/run under --packed-linear c+onednn

HAS_KERNEL = bool(cpu_kernels.load()) and INT8 in cpu_kernels.load().quant_types


@pytest.mark.parametrize("tp, kernels", [(1, True), pytest.param(2, True, marks=(pytest.mark.spawn, pytest.mark.slow)),
                                        (1, False)])
def test_int8_greedy_follows_the_int8_math(tiny_model_dir, tp, kernels):
    if kernels and not HAS_KERNEL:
        pytest.skip("csrc/linear_q.c needs AVX-512 VNNI")
    from transformers import AutoModelForCausalLM
    ref = int8_reference(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval(), tp)
    stats = assert_follows_reference(tiny_model_dir, ref, exact=tp == 1 and not kernels, quantization="int8",
                                     tensor_parallel_size=tp, cpu_kernels=kernels)
    assert stats["quantization"] == "int8" and stats["linear"] == ("int8" if kernels else "int8-torch")


def test_int8_runs_on_cpu_only(tiny_model_dir):
    from nanovllm_tp.config.engine_config import EngineConfig
    with pytest.raises(ValueError, match="quantization='int8' runs on CPU only: pass device='cpu'"):
        EngineConfig.from_kwargs(tiny_model_dir, quantization="int8", device="cuda").validate()


@smollm2
@pytest.mark.skipif(not HAS_KERNEL, reason="csrc/linear_q.c needs AVX-512 VNNI")
@pytest.mark.slow
def test_int8_perplexity_on_smollm2_stays_within_2_percent_of_bf16(tmp_path):
    """SmolLM2 dense (its Q4_1 file's weights saved as a bf16 checkpoint) on 4 chunks of the corpus, llama.cpp's
    scoring: int8 weights with activations per block of 128 within 2% of bf16's perplexity (with one scale per
    token, 24 chunks of the file's bf16 twin lost 3.96%; BENCHMARKS.md)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config          # the weights below are dense: a plain checkpoint
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    dense.load_state_dict({k: v.bfloat16() for k, v in loaded.state_dict().items()})
    dense.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp_path)
    ppl = {q: main(["--model", str(tmp_path), "--text", str(CORPUS), "--ctx", "512", "--llama-cpp", "--max-tokens",
                    "2048", "--dtype", "bfloat16", "--quantization", q, "--max-model-len", "1024"]).ppl
           for q in ("none", "int8")}
    assert 1.0 < ppl["int8"] / ppl["none"] < 1.02, ppl
