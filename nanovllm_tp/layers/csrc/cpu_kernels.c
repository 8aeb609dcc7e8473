/* fp32 and bf16 CPU kernels for the layers whose torch form is a chain of small ops (each a separate pass over memory
 * and a few microseconds of dispatch): RMSNorm (with the residual add fused in), neox RoPE and SiLU-and-mul. Paged
 * decode attention is in decode_attn.c (and decode_attn_simd.c), the quantized KV store in kv_store.c, the
 * sampler's kernels in sampler.c; all are built into one library and loaded with ctypes by
 * nanovllm_tp/layers/cpu_kernels.py.
 *
 * Threads: OpenMP. Built against the libgomp torch has already loaded, the kernels share torch's thread pool
 * and follow torch.set_num_threads. Small inputs stay on the calling thread (a parallel region costs more).
 * Built with -ffast-math (vectorised reductions and expf): no infinities are used, -FLT_MAX stands in.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PARALLEL_MIN_ELEMENTS 65536    /* below this an elementwise kernel runs on one thread */

#include "dtypes.h"
#include "layer_kernels.h"

/* ---------------------------------------------------------------- RMSNorm
 * x and out viewed as [outer, inner, size] with outer strides x_stride / out_stride and inner stride size (so a
 * [tokens, heads, dim] slice of the fused qkv output works in place). With residual (then inner == 1 and all
 * three contiguous): residual += x, and the sum is what gets normalised. out may be x.
 * Same order of operations as the reference: weight * (x * rsqrt(mean(x^2) + eps)).
 */
INLINE void rms_norm_row(const void *src, void *sum, const void *weight, void *dst, int size, float eps,
                         const int bf16)
{
    float squares = 0.f;
    if (sum) {            /* the sum is stored in the tensor's dtype and the stored value is normalised */
        for (int d = 0; d < size; d++) store(sum, d, load(sum, d, bf16) + load(src, d, bf16), bf16);
        src = sum;
    }
    for (int d = 0; d < size; d++) squares += load(src, d, bf16) * load(src, d, bf16);
    const float inv = 1.f / sqrtf(squares / size + eps);
    for (int d = 0; d < size; d++) store(dst, d, load(weight, d, bf16) * (load(src, d, bf16) * inv), bf16);
}

void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t outer, int64_t inner,
              int64_t x_stride, int64_t out_stride, int size, float eps, int bf16)
{
    const int64_t rows = outer * inner;
    #pragma omp parallel for if (rows * size >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t o = r / inner, i = r % inner;
        const void *src = AT(x, o * x_stride + i * size, bf16);
        void *dst = AT(out, o * out_stride + i * size, bf16), *sum = residual ? AT(residual, r * size, bf16) : NULL;
        if (bf16) rms_norm_row(src, sum, weight, dst, size, eps, 1);
        else rms_norm_row(src, sum, weight, dst, size, eps, 0);
    }
}

/* ---------------------------------------------------------------- rotary embedding (neox: rotate halves)
 * q [tokens, q_heads, dim] and k [tokens, k_heads, dim], each with its own token stride, rotated in place: the
 * first rot_dim features of each head (all of them but with partial rotary, as Phi-4-mini), the rest unchanged.
 * cos_sin [max_position, rot_dim]: the cosines of the rot_dim/2 frequencies, then their sines (bf16 when
 * cos_bf16 != 0: the table keeps its own dtype, as the torch code multiplies by it).
 */
INLINE void rotate(void *x, const void *cos, const void *sin, int half, const int bf16, const int cos_bf16)
{
    void *x2 = AT(x, half, bf16);
    for (int d = 0; d < half; d++) {
        const float a = load(x, d, bf16), b = load(x2, d, bf16);
        const float c = load(cos, d, cos_bf16), s = load(sin, d, cos_bf16);
        store(x, d, a * c - b * s, bf16);
        store(x2, d, b * c + a * s, bf16);
    }
}

INLINE void rope_token(void *q, void *k, const void *cos, int q_heads, int k_heads, int dim, int rot_dim,
                       const int bf16, const int cos_bf16)
{
    const int half = rot_dim / 2;
    const void *sin = AT(cos, half, cos_bf16);
    for (int h = 0; h < q_heads; h++) rotate(AT(q, (int64_t)h * dim, bf16), cos, sin, half, bf16, cos_bf16);
    for (int h = 0; h < k_heads; h++) rotate(AT(k, (int64_t)h * dim, bf16), cos, sin, half, bf16, cos_bf16);
}

void rope(void *q, void *k, const int64_t *positions, const void *cos_sin, int64_t tokens, int q_heads,
          int k_heads, int64_t q_stride, int64_t k_stride, int dim, int rot_dim, int bf16, int cos_bf16)
{
    #pragma omp parallel for if (tokens * (q_heads + k_heads) * dim >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        void *qt = AT(q, t * q_stride, bf16), *kt = AT(k, t * k_stride, bf16);
        const void *cos = AT(cos_sin, positions[t] * rot_dim, cos_bf16);
        if (bf16 && cos_bf16) rope_token(qt, kt, cos, q_heads, k_heads, dim, rot_dim, 1, 1);
        else if (bf16) rope_token(qt, kt, cos, q_heads, k_heads, dim, rot_dim, 1, 0);
        else if (cos_bf16) rope_token(qt, kt, cos, q_heads, k_heads, dim, rot_dim, 0, 1);
        else rope_token(qt, kt, cos, q_heads, k_heads, dim, rot_dim, 0, 0);
    }
}

/* ---------------------------------------------------------------- SiLU(gate) * up
 * x [tokens, 2 * width] (gate then up, as the merged gate_up projection writes them), out [tokens, width].
 */
INLINE void silu_mul_row(const void *gate, const void *up, void *out, int64_t width, const int bf16)
{
    for (int64_t d = 0; d < width; d++) {
        const float g = load(gate, d, bf16);
        store(out, d, g / (1.f + expf(-g)) * load(up, d, bf16), bf16);
    }
}

void silu_mul(const void *x, void *out, int64_t tokens, int64_t width, int bf16)
{
    #pragma omp parallel for if (tokens * width >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const void *gate = AT(x, t * 2 * width, bf16), *up = AT(gate, width, bf16);
        void *o = AT(out, t * width, bf16);
        if (bf16) silu_mul_row(gate, up, o, width, 1);
        else silu_mul_row(gate, up, o, width, 0);
    }
}
