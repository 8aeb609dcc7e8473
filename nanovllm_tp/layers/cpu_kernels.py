"""C kernels for fp32 and bf16 on CPU: paged decode attention (csrc/decode_attn.c, its AVX-512 form in
decode_attn_simd.c; over a cache in the model dtype or quantized: int8, fp8) and the quantized cache's store
(csrc/kv_store.c), csrc/cpu_kernels.c's RMSNorm with the residual add fused in, RoPE and SiLU-and-mul; linear
layers (csrc/linear.c: bf16 on CPUs with AVX-512 BF16, fp32 with AVX-512F); and rank 0's sampler over fp32 logits
(csrc/sampler.c): per-row top-k, logprobs, and one pass per entry from penalties to the drawn token.

In eager torch each of those is a chain of small ops, and on a CPU every op costs microseconds of dispatch plus a
pass over memory; the torch backend's decode also gathers and pads every row's K/V blocks. The kernels read the
paged cache in place and do each layer piece in one call. They are compiled once per machine with the C compiler
(`$CC`, else `cc`) into the user's cache directory (cpu_build.py) and loaded with ctypes; the sampler's wrappers
are in sampler_kernels.py. Without a compiler, for other dtypes,
or in an engine built with cpu_kernels=False (for comparisons: `switched`), every layer runs its torch code instead.
"""
import contextlib
import ctypes
import functools
import logging
import pathlib
import subprocess

import torch

from nanovllm_tp import envs
from nanovllm_tp.layers import cpu_build
from nanovllm_tp.layers.sampler_kernels import SamplerKernels, _rows_contiguous

log = logging.getLogger("nanovllm_tp")
_ptr, _i64, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {   # name -> (restype, argtypes), as declared in the C file
    "paged_decode": (_int, [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _int, _int, _int, _int, _int,
                            _float, _int, _float, _int, _int, _int]),
    "paged_decode_available_simd": (_int, []),
    "kv_store": (None, [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _int, _int, _int, _int, _int]),
    "copy_runs": (None, [_ptr, _ptr, _i64, _i64, _i64, _i64]),
    "rms_norm": (None, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int, _float, _int]),
    "rope": (None, [_ptr, _ptr, _ptr, _ptr, _i64, _int, _int, _i64, _i64, _int, _int, _int, _int]),
    "silu_mul": (None, [_ptr, _ptr, _i64, _i64, _int]),
    "linear_bf16_available": (_int, []),
    "pack_bf16_weight": (None, [_ptr, _ptr, _i64, _i64]),
    "linear_bf16": (None, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64]),
    "linear_f32_available": (_int, []),
    "pack_f32_weight": (None, [_ptr, _ptr, _i64, _i64]),
    "linear_f32": (None, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64]),
    "linear_q_available": (_int, []),
    "q_packed_bytes": (_i64, [_i64, _i64, _int]),
    "pack_q_weight": (None, [_ptr, _ptr, _i64, _i64, _int]),
    "linear_q": (_int, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int]),
    "gather_q_rows": (None, [_ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int]),
    "row_logprobs": (_int, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _int, _ptr, _ptr, _ptr, _ptr]),
    "sample_rows": (_int, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64,
                           _float, _ptr, _int, _ptr, _ptr, _ptr, _ptr]),
    "modify_rows": (None, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr]),
    "decoder_run": (_int, [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr]),
    "lora_apply": (_int, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _int]),
    "read_stream": (ctypes.c_uint64, [_ptr, _i64, _int, _int, _i64]),
}
DTYPES = (torch.float32, torch.bfloat16)   # the C functions' bf16 argument says which: 1 for bf16
KV_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}    # paged_decode's kv: quantized caches


class CpuKernels(SamplerKernels):
    """Typed wrappers over the library. Float inputs are CPU tensors of one dtype in DTYPES (other operands are
    cast to the activations' dtype); see each C function for layouts."""

    def __init__(self, path: pathlib.Path):
        lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, "_" + name, fn)
        # the dtypes csrc/linear.c was built for here (AVX-512 BF16 for bf16, AVX-512F for fp32)
        self.linear_dtypes = tuple(dt for dt, ok in ((torch.bfloat16, self._linear_bf16_available()),
                                                     (torch.float32, self._linear_f32_available())) if ok)
        # what csrc/linear_q.c runs (built with AVX-512 VNNI): ggml's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
        # Q6_K, and int8 (its code 100)
        self.quant_types = (2, 3, 6, 7, 8, 12, 13, 14, 100) if self._linear_q_available() else ()
        # paged decode's AVX-512 form (head_dim 32, 64, 128 or 256); the portable loop runs otherwise
        self.decode_simd = bool(self._paged_decode_available_simd())

    def pack_linear_weight(self, w: torch.Tensor) -> torch.Tensor:
        """w [n, k] (a dtype in linear_dtypes; k even for bf16) in csrc/linear.c's layout, flat: blocks of 16
        rows, each k/2 tiles of 16 x 2 (bf16) or k rows of 16 (fp32)."""
        n, k = w.shape
        w = w.detach().contiguous()
        packed = torch.empty(-(-n // 16) * 16 * k, dtype=w.dtype)
        pack = self._pack_bf16_weight if w.dtype is torch.bfloat16 else self._pack_f32_weight
        pack(w.data_ptr(), packed.data_ptr(), n, k)
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias=None) -> torch.Tensor:
        """x [m, k] @ w.T (+ bias) for a weight packed by pack_linear_weight; x in the weight's dtype."""
        if x.dtype is not packed.dtype:
            raise TypeError(f"linear: {x.dtype} activations for a {packed.dtype} weight")
        x = x.contiguous()
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        if bias is not None:
            bias = bias.to(x.dtype).contiguous()
        run = self._linear_bf16 if x.dtype is torch.bfloat16 else self._linear_f32
        run(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0], n,
            x.shape[1])
        return out

    def read_stream(self, buf: torch.Tensor, threads: int, streams: int, ahead: int) -> int:
        """One read of a contiguous buffer by `threads` threads, each its share as `streams` streams, prefetching
        `ahead` bytes in front (0: none); returns the XOR of its words (csrc/read_rate.c; bench/bandwidth.py
        times it)."""
        return self._read_stream(buf.data_ptr(), buf.numel() * buf.element_size(), threads, streams, ahead)

    def pack_quant_weight(self, raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
        """raw: a weight's rows as blocks of 32 of `qtype` ([n, k / 32 * block bytes] uint8: GGUF's, or
        quant_kblocks.unpack's; int8: [n, 4 + k]), in csrc/linear_q.c's layout (units of 32 rows; see there)."""
        n = raw.shape[0]
        size = self._q_packed_bytes(n, k, qtype)
        if size < 0:
            raise ValueError(f"csrc/linear_q.c does not run ggml type {qtype} with {k} inputs")
        raw = raw.contiguous()
        packed = torch.empty(size, dtype=torch.uint8)
        self._pack_q_weight(raw.data_ptr(), packed.data_ptr(), n, k, qtype)
        return packed

    def linear_quant(self, x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int, bias=None) -> torch.Tensor:
        """x [m, k] (fp32 or bf16) @ w.T (+ bias) for a weight packed by pack_quant_weight; out in x's dtype."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        if bias is not None:
            bias = bias.float().contiguous()
        if self._linear_q(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                          out.data_ptr(), x.shape[0], n, x.shape[1], qtype, _bf16(x)):
            raise MemoryError("the quantized linear kernel could not allocate its activation scratch")
        return out

    def gather_quant_rows(self, packed: torch.Tensor, ids: torch.Tensor, qtype: int, n: int, k: int,
                          dtype: torch.dtype) -> torch.Tensor:
        """Rows ids (each in [0, n)) of a weight packed by pack_quant_weight, dequantized into dtype."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), k, dtype=dtype)
        self._gather_q_rows(packed.data_ptr(), ids.data_ptr(), out.data_ptr(), ids.numel(), n, k, qtype,
                            int(dtype is torch.bfloat16))
        return out

    def paged_decode(self, q, k_cache, v_cache, block_tables, context_lens, scale: float, window: int = 0,
                     softcap: float = 0.0, kv_scales=None, portable: bool = False) -> torch.Tensor:
        """window > 0: each row sees its last `window` tokens only; softcap > 0: scores capped by tanh.
        kv_scales: a quantized cache's (K, V) fp32 scales [num_blocks, block_size, kv_heads] (the caches then
        int8 or fp8, see kv_quant.py); None: the caches are in q's dtype. portable: the portable loop even where
        the AVX-512 form runs (comparisons: tests, bench/attention.py)."""
        rows, heads, dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        q = q.contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        out = torch.empty_like(q)
        want = q.dtype if kv_scales is None else k_cache.dtype
        if k_cache.dtype is not want or v_cache.dtype is not want or (kv_scales and want not in KV_CODES):
            raise TypeError(f"KV cache {k_cache.dtype}/{v_cache.dtype} for {q.dtype} queries "
                            f"{'without' if kv_scales is None else 'with'} scales")
        k_scale, v_scale = kv_scales or (None, None)
        if kv_scales is not None and not all(t.dtype is torch.float32 and t.is_contiguous() and
                                             t.shape == k_cache.shape[:3] for t in kv_scales):
            raise TypeError("KV scales must be contiguous float32 [num_blocks, block_size, kv_heads]")
        if self._paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                              None if k_scale is None else k_scale.data_ptr(),
                              None if v_scale is None else v_scale.data_ptr(), tables.data_ptr(),
                              tables.stride(0), lens.data_ptr(), out.data_ptr(), rows, heads, kv_heads, dim,
                              block_size, scale, window, softcap, _bf16(q), KV_CODES.get(want, 0), int(portable)):
            raise MemoryError("the CPU paged-decode kernel could not allocate its scratch buffers")
        return out

    def kv_store(self, x, slot_mapping, cache, scales, readback: bool) -> torch.Tensor:
        """x [tokens, heads, dim] quantized into its slots of an 8-bit cache [.., heads, dim] (int8 or fp8, see
        KV_CODES; fp32 scales [.., heads]), a scale per token and head (kv_quant.quantize's math, to the bit);
        returns x dequantized (readback, in place when x's rows are contiguous) or x."""
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            x = x.contiguous()
        elif readback:
            x = x.clone()        # x may be a view of the qkv projection that other code still reads
        slots = slot_mapping.to(torch.int64).contiguous()
        tokens, heads, dim = x.shape
        self._kv_store(x.data_ptr(), x.stride(0), slots.data_ptr(), cache.data_ptr(), scales.data_ptr(), tokens,
                       heads, dim, _bf16(x), KV_CODES[cache.dtype], int(readback))
        return x

    def copy_runs(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst[...] = src for two uint8 CPU views of one shape [chunks, ...] whose rows past the first dimension
        are contiguous (a layer's blocks of a KV cache), each row one run of memcpy pieces over the threads."""
        if dst.shape != src.shape or not (dst[0].is_contiguous() and src[0].is_contiguous()) or dst.dtype != src.dtype:
            raise ValueError("copy_runs needs two views of one shape and dtype, contiguous past their first dim")
        self._copy_runs(src.data_ptr(), dst.data_ptr(), src.shape[0], src[0].numel() * src.element_size(),
                        src.stride(0) * src.element_size(), dst.stride(0) * dst.element_size())

    def rms_norm(self, x, weight, eps: float, residual=None):
        """x [..., size] (rows may be strided, e.g. heads sliced out of a fused projection). With residual
        ([tokens, size], contiguous) the sum x + residual is written into residual and normalised."""
        shape, size = x.shape, x.shape[-1]
        if weight.dtype is x.dtype:            # the usual cases in few torch calls: each costs about a microsecond
            st = x.stride()
            if residual is None and len(st) == 3 and st[2] == 1 and st[1] == size:   # heads of a fused projection
                out = torch.empty(shape, dtype=x.dtype)
                self._rms_norm(x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), shape[0], shape[1], st[0],
                               shape[1] * size, size, eps, _bf16(x))
                return out
            if x.is_contiguous() and (residual is None or residual.is_contiguous()):
                out = torch.empty_like(x)
                self._rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                               out.data_ptr(), x.numel() // size, 1, size, size, size, eps, _bf16(x))
                return out if residual is None else (out, residual)
        if residual is not None:
            x, residual = x.contiguous(), residual.contiguous()
        if x.stride(-1) != 1 or x.dim() not in (2, 3) or (x.dim() == 3 and x.stride(1) != size):
            x = x.contiguous().view(-1, size)
        outer, inner = x.shape[0], (x.shape[1] if x.dim() == 3 else 1)
        out = torch.empty(x.shape, dtype=x.dtype)
        weight = weight.to(x.dtype).contiguous()
        self._rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                       out.data_ptr(), outer, inner, x.stride(0), inner * size, size, eps, _bf16(x))
        out = out.view(shape)
        return out if residual is None else (out, residual)

    def rope(self, q, k, positions, cos_sin):
        """Rotates q and k ([tokens, heads, dim]) in place (copies first unless heads are contiguous rows): the
        first cos_sin.shape[1] features of each head (partial rotary when that is less than dim)."""
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            q = q.contiguous()
        if k.stride(2) != 1 or k.stride(1) != k.shape[2]:
            k = k.contiguous()
        if positions.dtype is not torch.int64:
            positions = positions.to(torch.int64)
        tokens, q_heads, dim = q.shape
        if cos_sin.dtype not in DTYPES:
            cos_sin = cos_sin.float()
        self._rope(q.data_ptr(), k.data_ptr(), positions.contiguous().data_ptr(), cos_sin.data_ptr(), tokens,
                   q_heads, k.shape[1], q.stride(0), k.stride(0), dim, cos_sin.shape[1], _bf16(q), _bf16(cos_sin))
        return q, k

    def silu_mul(self, x) -> torch.Tensor:
        x = x.contiguous()
        rows, width = x.numel() // x.shape[-1], x.shape[-1] // 2
        out = torch.empty(x.shape[:-1] + (width,), dtype=x.dtype)
        self._silu_mul(x.data_ptr(), out.data_ptr(), rows, width, _bf16(x))
        return out

    def lora_apply(self, tables, groups, x, y) -> None:
        """y[t] += B[s] (A[s] x[t]) in place for the tokens t of each slot s of `groups`, csrc/lora.h's structs:
        `tables` a lora.layers.LoRATables (one layer's slot tables, fp32 or bf16), `groups` a lora.layers.SlotGroups
        (its `desc`). x and y [tokens, features] share a dtype (fp32 or bf16)."""
        x = _rows_contiguous(x)
        if y.stride(-1) != 1 or x.dtype is not y.dtype:
            raise ValueError("lora_apply: y's rows must be contiguous, x and y of one dtype")
        if self._lora_apply(ctypes.byref(tables), ctypes.byref(groups.desc), x.data_ptr(), y.data_ptr(), x.stride(0),
                            y.stride(0), _bf16(x)):
            raise MemoryError("the LoRA kernel could not allocate its scratch")


@functools.cache
def load() -> CpuKernels | None:
    """The kernels, or None (logged once) where they cannot be built here."""
    compiler = cpu_build.compiler()
    if compiler is None:
        log.warning("no C compiler found ($CC or cc): CPU layers run as plain torch ops (slower)")
        return None
    try:
        return CpuKernels(cpu_build.build_library(compiler))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("could not build the CPU kernels (%s): CPU layers run as plain torch ops (slower)", e)
        return None


def _default_switch() -> bool:
    return envs.flag("NANOVLLM_TP_CPU_KERNELS")


_switch = [_default_switch()]     # whether the engine running now uses the kernels (its cpu_kernels knob)


@contextlib.contextmanager
def switched(on: bool):
    """Run with the kernels on or off (an engine's cpu_kernels), then restore the previous setting: each engine
    of a process builds and steps under its own."""
    saved, _switch[0] = _switch[0], on
    try:
        yield
    finally:
        _switch[0] = saved


def active() -> CpuKernels | None:
    """The kernels when they are built here and switched on."""
    return load() if _switch[0] else None


def _bf16(x: torch.Tensor) -> int:
    return int(x.dtype is torch.bfloat16)


def for_tensor(x: torch.Tensor) -> CpuKernels | None:
    """The kernels when x is an fp32 or bf16 CPU tensor and they are available; the layers' torch code runs
    otherwise."""
    return active() if x.dtype in DTYPES and x.is_cpu else None
