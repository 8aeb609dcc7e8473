"""The reference of a quantized KV cache: transformers whose attention reads every K and V vector (one token, one
KV head) after a round trip through 8-bit values with one scale of its own, written here from the format's
definition: scale = absmax / QMAX, int8 values rounded to nearest (ties to even), fp8 values torch's cast.

Tokens are compared up to the reference's first near tie (two best logits closer than NEAR_TIE): there a sum in
another order may pick the other token, and a different token changes the rest of the sequence."""
import torch

from tests.helpers import hf_greedy

TOKENS = 24
NEAR_TIE = 0.01
LENGTHS = (1, 7, 16, 33, 64, 100, 180, 257)       # prompt lengths (tests.helpers.mixed_prompts)

FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0),
           "fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}


def roundtrip(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """x [..., head_dim] as an 8-bit cache of this format gives it back."""
    dtype, qmax = FORMATS[kv_cache_dtype]
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / qmax
    y = xf / torch.where(scale > 0, scale, torch.ones_like(scale))
    y = y.round().clamp(-qmax, qmax) if dtype is torch.int8 else y.clamp(-qmax, qmax).to(dtype).float()
    return (y * scale).to(x.dtype)


def kv_quantized_model(model_dir: str, kv_cache_dtype: str, dtype=torch.float32):
    """A transformers model of model_dir whose SDPA attention reads K/V round-tripped through kv_cache_dtype."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    name = f"sdpa_kv_{kv_cache_dtype}"

    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, roundtrip(key, kv_cache_dtype), roundtrip(value, kv_cache_dtype),
                                      attention_mask, **kwargs)

    AttentionInterface.register(name, attention)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=name).eval()


def query_as_read(q: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """q as the CPU decode kernel's vector form reads it: over an int8 cache it scores in integers, each query head
    rounded to int16 with a power-of-two scale (its largest value in [2^14, 2^15), ties to even, saturated); over
    every other format (and where the vector form does not run: not built, or a head_dim it lacks) q as it is."""
    from nanovllm_tp.layers import cpu_kernels
    if kv_cache_dtype != "int8" or not cpu_kernels.load().decode_simd or q.shape[-1] not in (32, 64, 128, 256):
        return q
    qf = q.float()
    scale = torch.exp2(torch.frexp(qf.abs().amax(-1, keepdim=True)).exponent - 15.0)
    return (qf / scale).round().clamp(-32768, 32767) * scale


_references = {}


def reference(model_dir: str, kv: str, prompts) -> list[tuple[list[int], list[float]]]:
    """The round-tripped model's greedy tokens per prompt, and the gap between its two best logits at each."""
    if kv not in _references:
        ref = kv_quantized_model(model_dir, kv)
        runs = []
        for p in prompts:
            tokens = hf_greedy(ref, p, TOKENS)
            with torch.no_grad():
                top = ref(torch.tensor([p + tokens])).logits[0, len(p) - 1:-1].topk(2, -1).values
            runs.append((tokens, (top[:, 0] - top[:, 1]).tolist()))
        _references[kv] = runs
    return _references[kv]


def assert_follows(outputs, runs) -> None:
    compared = 0
    for i, (out, (tokens, gaps)) in enumerate(zip(outputs, runs)):
        decisive = next((j for j, gap in enumerate(gaps) if gap < NEAR_TIE), TOKENS)
        got = out if isinstance(out, list) else out.outputs[0].token_ids
        assert got[:decisive] == tokens[:decisive], f"prompt {i} diverges before the reference's first near tie"
        compared += decisive
    assert compared >= len(runs) * TOKENS * 3 // 4
