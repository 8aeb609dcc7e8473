"""`torch-cuda`, CUDA's backend when flash-attn is not in use: torch's varlen attention for bf16/fp16 prefill
without a cached prefix where this torch has it, a Triton paged kernel for every other prefill (cached prefixes,
fp32), and a Triton paged split-K kernel for decode (captured in CUDA graphs). The Triton kernels read dense caches:
a quantized KV cache reaches them dequantized (base.py: the step's blocks copied into the model dtype first)."""
import inspect

from nanovllm_tp.layers.attention.base import HALF, register_backend
from nanovllm_tp.layers.attention.torch_sdpa import TorchBackend


def _torch_varlen():
    """torch's varlen attention and the names of its keyword arguments, or (None, ()) where this torch has
    none or one without a softmax scale argument (torch 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, ()
    params = tuple(inspect.signature(varlen_attn).parameters)
    return (varlen_attn, params) if "scale" in params else (None, ())


@register_backend
class CudaTorchBackend(TorchBackend):
    name = "torch-cuda"
    devices = ("cuda",)
    supports_graphs = True
    reads_quantized = False     # the torch backend's reads do, the Triton kernels do not

    def __init__(self):
        from nanovllm_tp.layers.triton_decode import paged_decode_attention
        from nanovllm_tp.layers.triton_prefill import paged_prefill_attention
        self.decode_kernel, self.prefill_kernel = paged_decode_attention, paged_prefill_attention
        self.varlen, self.varlen_params = _torch_varlen()

    @classmethod
    def block_size_problem(cls, block_size: int) -> str | None:
        if block_size & (block_size - 1) == 0 and 8 <= block_size <= 1024:
            return None
        return "the torch-cuda backend's Triton kernels need a power of two in [8, 1024]"

    def prefill(self, q, k, v, k_cache, v_cache, ctx, scale, window=0, softcap=0.0, kv_scales=None):
        varlen_fits = not softcap and (not window or "window_size" in self.varlen_params)
        if self.varlen is not None and varlen_fits and not ctx.has_cached_prefix and q.dtype in HALF:
            return self._varlen_prefill(q, k, v, ctx, scale, window)
        if k_cache.numel():      # a cached prefix, fp32, no varlen (or none for this layer): the paged kernel
            return self.prefill_kernel(q, k_cache, v_cache, ctx.block_tables, ctx.cu_seqlens_q, ctx.context_lens,
                                       ctx.max_seqlen_q, scale, window, softcap)
        return super().prefill(q, k, v, k_cache, v_cache, ctx, scale, window, softcap)

    def decode(self, q, k_cache, v_cache, ctx, scale, window=0, softcap=0.0, kv_scales=None):
        return self.decode_kernel(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale,
                                  window=window, softcap=softcap)

    def _varlen_prefill(self, q, k, v, ctx, scale, window):
        kwargs = {"scale": scale}
        if window:
            kwargs["window_size"] = (window - 1, 0)
        elif "is_causal" in self.varlen_params:
            kwargs["is_causal"] = True
        else:
            kwargs["window_size"] = (-1, 0)
        if k.shape[1] != q.shape[1]:
            if "enable_gqa" in self.varlen_params:
                kwargs["enable_gqa"] = True
            else:
                repeat = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return self.varlen(q, k, v, ctx.cu_seqlens_q, ctx.cu_seqlens_q, ctx.max_seqlen_q, ctx.max_seqlen_q,
                           **kwargs)
