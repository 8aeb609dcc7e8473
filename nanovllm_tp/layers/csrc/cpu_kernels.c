/* fp32 CPU kernels for the layers whose torch form is a chain of small ops (each a separate pass over memory
 * and a few microseconds of dispatch): paged decode attention, RMSNorm (with the residual add fused in),
 * neox RoPE and SiLU-and-mul. Loaded with ctypes by nanovllm_tp/layers/cpu_kernels.py.
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

/* ---------------------------------------------------------------- paged decode attention
 * One query token per row attends to its K/V in place in the paged cache: nothing is gathered or padded.
 *   q, out   [rows, heads, dim]
 *   k/v      [num_blocks, block_size, kv_heads, dim]
 *   tables   [rows, table_stride] int32 block ids, lens [rows] int32 context lengths
 * A row is one unit of work. Its blocks are visited once, in order, with an online softmax (running max and
 * sum per head, as flash-decoding does), and the next block is prefetched while this one is used: blocks
 * sit at random places in a large pool, so memory latency, not arithmetic, is what costs.
 */
static inline __attribute__((always_inline)) void
decode_row(const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int len, int heads,
           int kv_heads, const int dim, int block_size, float scale, float *scratch, float *out)
{
    const int group = heads / kv_heads;
    const int64_t token_stride = (int64_t)kv_heads * dim, block_floats = (int64_t)block_size * token_stride;
    float *scores = scratch, *running_max = scratch + (int64_t)heads * block_size, *running_sum = running_max + heads;
    memset(out, 0, sizeof(float) * heads * dim);
    for (int h = 0; h < heads; h++) {
        running_max[h] = -FLT_MAX;
        running_sum[h] = 0.f;
    }
    const int blocks = (len + block_size - 1) / block_size;
    for (int b = 0; b < blocks; b++) {
        const float *k_block = k_cache + table[b] * block_floats, *v_block = v_cache + table[b] * block_floats;
        const int n = len - b * block_size < block_size ? len - b * block_size : block_size;
        if (b + 1 < blocks) {
            const char *next_k = (const char *)(k_cache + table[b + 1] * block_floats);
            const char *next_v = (const char *)(v_cache + table[b + 1] * block_floats);
            for (int64_t byte = 0; byte < block_floats * (int64_t)sizeof(float); byte += 64) {
                __builtin_prefetch(next_k + byte);
                __builtin_prefetch(next_v + byte);
            }
        }
        for (int i = 0; i < n; i++) {          /* scores[h][i] = scale * <q_h, k_i> */
            for (int kv = 0; kv < kv_heads; kv++) {
                const float *k = k_block + i * token_stride + kv * dim;
                for (int h = kv * group; h < (kv + 1) * group; h++) {
                    const float *qh = q + (int64_t)h * dim;
                    float dot = 0.f;
                    for (int d = 0; d < dim; d++) dot += qh[d] * k[d];
                    scores[h * block_size + i] = dot * scale;
                }
            }
        }
        for (int h = 0; h < heads; h++) {      /* fold the block into the running softmax */
            float *s = scores + h * block_size, block_max = running_max[h], sum = 0.f;
            for (int i = 0; i < n; i++) block_max = s[i] > block_max ? s[i] : block_max;
            const float rescale = expf(running_max[h] - block_max);
            for (int i = 0; i < n; i++) {
                s[i] = expf(s[i] - block_max);
                sum += s[i];
            }
            running_sum[h] = running_sum[h] * rescale + sum;
            running_max[h] = block_max;
            float *o = out + (int64_t)h * dim;
            for (int d = 0; d < dim; d++) o[d] *= rescale;
        }
        for (int i = 0; i < n; i++) {          /* out[h] += p[h][i] * v_i */
            for (int kv = 0; kv < kv_heads; kv++) {
                const float *v = v_block + i * token_stride + kv * dim;
                for (int h = kv * group; h < (kv + 1) * group; h++) {
                    const float p = scores[h * block_size + i];
                    float *o = out + (int64_t)h * dim;
                    for (int d = 0; d < dim; d++) o[d] += p * v[d];
                }
            }
        }
    }
    for (int h = 0; h < heads && len > 0; h++) {
        const float inv = 1.f / running_sum[h];
        for (int d = 0; d < dim; d++) out[(int64_t)h * dim + d] *= inv;
    }
}

int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *tables,
                     int64_t table_stride, const int32_t *lens, float *out, int rows, int heads, int kv_heads,
                     int dim, int block_size, float scale)
{
    int failed = 0;
    #pragma omp parallel if (rows > 1)
    {
        float *scratch = malloc(sizeof(float) * ((size_t)heads * block_size + 2 * (size_t)heads));
        /* every thread must reach the worksharing loop, so a thread without scratch only reports it */
        #pragma omp for schedule(dynamic, 1)
        for (int r = 0; r < rows; r++) {
            if (!scratch) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            const float *qr = q + (int64_t)r * heads * dim;
            const int32_t *table = tables + (int64_t)r * table_stride;
            float *o = out + (int64_t)r * heads * dim;
            /* head_dim as a compile-time constant in the common cases, so the inner loops unroll fully */
#define DECODE_ROW(DIM) decode_row(qr, k_cache, v_cache, table, lens[r], heads, kv_heads, DIM, block_size, scale, \
                                   scratch, o)
            switch (dim) {
            case 64: DECODE_ROW(64); break;
            case 128: DECODE_ROW(128); break;
            case 32: DECODE_ROW(32); break;
            default: DECODE_ROW(dim);
            }
#undef DECODE_ROW
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------- RMSNorm
 * x and out viewed as [outer, inner, size] with outer strides x_stride / out_stride and inner stride size (so a
 * [tokens, heads, dim] slice of the fused qkv output works in place). With residual (then inner == 1 and all
 * three contiguous): residual += x, and the sum is what gets normalised. out may be x.
 * Same order of operations as the reference: weight * (x * rsqrt(mean(x^2) + eps)).
 */
void rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t outer, int64_t inner,
                  int64_t x_stride, int64_t out_stride, int size, float eps)
{
    const int64_t rows = outer * inner;
    #pragma omp parallel for if (rows * size >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t o = r / inner, i = r % inner;
        const float *src = x + o * x_stride + i * size;
        float *dst = out + o * out_stride + i * size;
        float squares = 0.f;
        if (residual) {
            float *sum = residual + r * size;
            for (int d = 0; d < size; d++) {
                sum[d] += src[d];
                squares += sum[d] * sum[d];
            }
            src = sum;
        } else {
            for (int d = 0; d < size; d++) squares += src[d] * src[d];
        }
        const float inv = 1.f / sqrtf(squares / size + eps);
        for (int d = 0; d < size; d++) dst[d] = weight[d] * (src[d] * inv);
    }
}

/* ---------------------------------------------------------------- rotary embedding (neox: rotate halves)
 * q [tokens, q_heads, dim] and k [tokens, k_heads, dim], each with its own token stride, rotated in place.
 * cos_sin [max_position, dim]: the cosines of the dim/2 frequencies, then their sines.
 */
static inline void rotate(float *x, const float *cos, const float *sin, int half)
{
    float *x2 = x + half;
    for (int d = 0; d < half; d++) {
        const float a = x[d], b = x2[d];
        x[d] = a * cos[d] - b * sin[d];
        x2[d] = b * cos[d] + a * sin[d];
    }
}

void rope_f32(float *q, float *k, const int64_t *positions, const float *cos_sin, int64_t tokens, int q_heads,
              int k_heads, int64_t q_stride, int64_t k_stride, int dim)
{
    const int half = dim / 2;
    #pragma omp parallel for if (tokens * (q_heads + k_heads) * dim >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *cos = cos_sin + positions[t] * dim, *sin = cos + half;
        for (int h = 0; h < q_heads; h++) rotate(q + t * q_stride + (int64_t)h * dim, cos, sin, half);
        for (int h = 0; h < k_heads; h++) rotate(k + t * k_stride + (int64_t)h * dim, cos, sin, half);
    }
}

/* ---------------------------------------------------------------- SiLU(gate) * up
 * x [tokens, 2 * width] (gate then up, as the merged gate_up projection writes them), out [tokens, width].
 */
void silu_mul_f32(const float *x, float *out, int64_t tokens, int64_t width)
{
    #pragma omp parallel for if (tokens * width >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *gate = x + t * 2 * width, *up = gate + width;
        float *o = out + t * width;
        for (int64_t d = 0; d < width; d++) o[d] = gate[d] / (1.f + expf(-gate[d])) * up[d];
    }
}
