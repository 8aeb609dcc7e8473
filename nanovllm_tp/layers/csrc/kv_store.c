/* The quantized KV cache's store (layers/attention/kv_quant.py has the format and its torch form): a step's K or V
 * vectors, one per token and KV head, each written as 8-bit values with an fp32 scale of its own, the math of
 * kv_quant.quantize to the bit: scale = absmax / QMAX; value = x / max(scale, FLT_MIN), clamped to +-QMAX, then
 * int8: rounded half to even; fp8 e4m3 / e5m2: torch's cast (c10's rounding of an fp32 to the nearest code, ties
 * to even, written out below). The attention layer calls it for every quantized cache on CPU, and decoder.c for
 * the fused decode layers, so both hold the same bytes.
 *
 * Built without -ffast-math (whose reciprocals and flushes round differently): the per-vector function has the
 * attribute and is not inlined into the OpenMP region, whose outlined body would not keep it.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "decode_attn.h"
#include "dtypes.h"
#include "layer_kernels.h"

#define PARALLEL_MIN_ELEMENTS 65536    /* below this the store runs on one thread */

enum { KV_INT8 = 1, KV_E4M3 = 2, KV_E5M2 = 3 };      /* cpu_kernels.KV_CODES */

static uint32_t bits_of(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static float float_of(uint32_t b)
{
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* fp32 -> fp8 code, nearest with ties to even (|f| already clamped to the format's largest value). Normal
 * results: the mantissa's dropped bits rounded by adding half an ulp less one plus the kept lowest bit, the
 * exponent rebased. Subnormal results (e4m3 below 2^-6, e5m2 below 2^-14): an fp32 addition of a power of two
 * whose ulp is the code's step does the rounding, and its low bits are the code. */
__attribute__((optimize("no-fast-math"))) static uint8_t fp8_code(float f, int e4m3)
{
    const int shift = e4m3 ? 20 : 21;                       /* fp32 mantissa bits below the code's */
    const uint32_t min_normal = (e4m3 ? 121u : 113u) << 23;  /* 2^-6, 2^-14 */
    const uint32_t denorm = (e4m3 ? 141u : 134u) << 23;      /* 2^14, 2^7: ulp 2^-9, 2^-16 */
    uint32_t b = bits_of(f);
    const uint32_t sign = b & 0x80000000u;
    b ^= sign;
    uint8_t code;
    if (b < min_normal) {
        code = (uint8_t)(bits_of(float_of(b) + float_of(denorm)) - denorm);
    } else {
        const uint32_t odd = (b >> shift) & 1u;
        b += ((uint32_t)((e4m3 ? 7 : 15) - 127) << 23) + ((1u << (shift - 1)) - 1u) + odd;
        code = (uint8_t)(b >> shift);
    }
    return code | (uint8_t)(sign >> 24);
}

/* one vector of dim values of x into dst; returns its scale. readback: x becomes the dequantized values */
__attribute__((noinline, optimize("no-fast-math"))) static float
quantize_vector(void *x, uint8_t *dst, int dim, int bf16, int kv, int readback)
{
    const float qmax = kv == KV_INT8 ? 127.f : kv == KV_E4M3 ? 448.f : 57344.f;
    float absmax = 0.f;
    for (int d = 0; d < dim; d++) {
        const float a = fabsf(load(x, d, bf16));
        absmax = a > absmax ? a : absmax;
    }
    const float scale = absmax / qmax, divisor = scale > FLT_MIN ? scale : FLT_MIN;
    for (int d = 0; d < dim; d++) {
        float y = load(x, d, bf16) / divisor;
        y = y > qmax ? qmax : y < -qmax ? -qmax : y;
        float back;
        if (kv == KV_INT8) {
            y = nearbyintf(y);
            dst[d] = (uint8_t)(int8_t)y;
            back = y;
        } else {
            dst[d] = fp8_code(y, kv == KV_E4M3);
            back = (kv == KV_E4M3 ? fp8_e4m3_values : fp8_e5m2_values)[dst[d]];
        }
        if (readback) store(x, d, back * scale, bf16);
    }
    return scale;
}

void kv_store(void *x, int64_t x_stride, const int64_t *slots, void *cache, float *scales, int64_t tokens, int heads,
              int dim, int bf16, int kv, int readback)
{
    const int64_t vectors = tokens * heads;
    #pragma omp parallel for if (vectors * dim >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t e = 0; e < vectors; e++) {
        const int64_t t = e / heads, h = e % heads, slot = slots[t] * heads + h;
        scales[slot] = quantize_vector(AT(x, t * x_stride + h * dim, bf16), (uint8_t *)cache + slot * dim, dim, bf16,
                                       kv, readback);
    }
}

/* A request's KV blocks copied between two caches (workers/kv_blocks.py: a request that moves between engines):
 * `chunks` runs of `bytes` each, the i-th at src + i * src_stride and dst + i * dst_stride (a layer's consecutive
 * blocks, one layer after another). Each run is cut into pieces of COPY_PIECE bytes spread over the threads, each
 * piece one memcpy: twice as fast as torch's strided copy of the same views here, whose elementwise loop keeps to
 * smaller moves. */
#define COPY_PIECE (256 * 1024)
#define PARALLEL_MIN_COPY (1 << 20)

void copy_runs(const uint8_t *src, uint8_t *dst, int64_t chunks, int64_t bytes, int64_t src_stride,
               int64_t dst_stride)
{
    int64_t per = (bytes + COPY_PIECE - 1) / COPY_PIECE, total = chunks * per;
    #pragma omp parallel for if (chunks * bytes >= PARALLEL_MIN_COPY) schedule(static)
    for (int64_t i = 0; i < total; i++) {
        int64_t c = i / per, off = (i % per) * COPY_PIECE;
        int64_t n = bytes - off < COPY_PIECE ? bytes - off : COPY_PIECE;
        memcpy(dst + c * dst_stride + off, src + c * src_stride + off, (size_t)n);
    }
}
