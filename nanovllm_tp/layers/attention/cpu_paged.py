"""`cpu`: the torch backend's prefill for longer prompts, and decode (prompts up to 512 tokens too, as decode
rows) read in place from the paged cache by the C kernel (layers/cpu_kernels.py; fp32 and bf16 queries, KV in the
model dtype or quantized: int8, fp8 e4m3/e5m2 with their scales). The default on CPU wherever the kernels build."""
from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.attention.base import register_backend
from nanovllm_tp.layers.attention.torch_sdpa import TorchBackend


@register_backend
class CpuBackend(TorchBackend):
    name = "cpu"
    devices = ("cpu",)
    # Prompts of up to 512 tokens in all run through the C kernel too, each token a decode row reading the KV up to
    # itself in place: 1.5-3.1x SDPA's causal prefill at 32-512 tokens on an AMD EPYC (AVX-512 BF16, 2 threads;
    # SmolLM2's, Llama-3.2-1B's and Qwen3's heads), 1.1-1.5x at 1024, 1.0-1.2x at 2048, where SDPA's blocking
    # catches up (`bench prompt-attention`)
    prompt_as_decode = 512

    @classmethod
    def unavailable(cls, dtype) -> str | None:
        if dtype not in cpu_kernels.DTYPES:
            return f"the C kernels take float32 and bfloat16, not {dtype}"
        if cpu_kernels.active() is None:
            return "the C kernels are not available here (no C compiler, a failed build, or cpu_kernels=False)"
        return None

    def decode(self, q, k_cache, v_cache, ctx, scale, window=0, softcap=0.0, kv_scales=None):
        kernels = cpu_kernels.for_tensor(q)
        if kernels is None:
            return super().decode(q, k_cache, v_cache, ctx, scale, window, softcap, kv_scales)
        return kernels.paged_decode(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale, window, softcap,
                                    kv_scales)
