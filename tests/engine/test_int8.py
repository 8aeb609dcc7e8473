"""quantization="int8": a dense checkpoint's linear layers and LM head quantized at load to int8 per output channel
(as vLLM's W8A8 on CPU), activations quantized per block of 128 inputs. The engine's greedy tokens against
transformers with the same int8 weights and inputs rounded per block (tests/quant_reference.py), TP 1 and 2,
through csrc/linear_q.c and through the torch reference; the embedding stays dense."""
import pytest
import torch

from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.quant import INT8
from tests.quant_reference import assert_follows_reference, int8_reference

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
    from nanovllm_tp.config import EngineConfig
    with pytest.raises(ValueError, match="quantization='int8' runs on CPU only: pass device='cpu'"):
        EngineConfig.from_kwargs(tiny_model_dir, quantization="int8", device="cuda").validate()
