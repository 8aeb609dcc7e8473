"""`cpu`: the torch backend's prefill, and decode read in place from the paged cache by the C kernel
(layers/cpu_kernels.py; fp32 and bf16 queries, KV in the model dtype or quantized: int8, fp8 e4m3/e5m2 with their
scales). The default on CPU wherever the kernels build."""
from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.attention.base import register_backend
from nanovllm_tp.layers.attention.torch_sdpa import TorchBackend


@register_backend
class CpuBackend(TorchBackend):
    name = "cpu"
    devices = ("cpu",)

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
