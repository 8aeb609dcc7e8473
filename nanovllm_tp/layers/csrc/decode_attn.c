/* Paged decode attention: one query token per row attends to its K/V in place in the paged cache, nothing
 * gathered or padded. The entry point, paged_decode, runs the AVX-512 form of decode_attn_simd.c where this build
 * and head_dim have one, else (or when asked: portable != 0, for comparisons) the portable loop below.
 *
 *   q, out    [rows, heads, dim] fp32, or bf16 when bf16 != 0 (computed in fp32)
 *   k/v       [num_blocks, block_size, kv_heads, dim] in q's dtype (kv 0) or 8-bit (kv 1-3, see below) with
 *   k/v_scale [num_blocks, block_size, kv_heads] fp32: a quantized vector is widened in registers, its scale
 *             applied once to the dot product (K) and to the probability (V)
 *   tables    [rows, table_stride] int32 block ids, lens [rows] int32 context lengths
 * window > 0: the query (at position len - 1) sees only the last `window` tokens; blocks before them are never
 * read (their table entries may be stale). softcap > 0: scores become softcap * tanh(score / softcap).
 * Built with -ffast-math: no infinities are used, -FLT_MAX stands in.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_attn.h"
#include "dtypes.h"

/* ---------------------------------------------------------------- quantized KV values
 * A quantized KV cache (kv_cache_dtype, layers/attention/kv_quant.py) holds 8-bit values, each token's vector of
 * one KV head with one fp32 scale: kv 1 = int8, 2 = fp8 e4m3 (torch.float8_e4m3fn), 3 = fp8 e5m2; kv 0 = the
 * query's dtype, unscaled. fp8 is widened through a 256-entry table (decode_attn.h; kv_store.c reads it back too).
 */
float fp8_e4m3_values[256], fp8_e5m2_values[256];

__attribute__((constructor)) static void fill_fp8_tables(void)
{
    for (int b = 0; b < 256; b++) {
        const float sign = b & 0x80 ? -1.f : 1.f;
        const int e4 = (b >> 3) & 15, m3 = b & 7, e5 = (b >> 2) & 31, m2 = b & 3;
        fp8_e4m3_values[b] = e4 == 15 && m3 == 7 ? 0.f
                      : sign * (e4 ? ldexpf(1.f + m3 / 8.f, e4 - 7) : ldexpf(m3 / 8.f, -6));
        fp8_e5m2_values[b] = e5 == 31 ? 0.f : sign * (e5 ? ldexpf(1.f + m2 / 4.f, e5 - 15) : ldexpf(m2 / 4.f, -14));
    }
}

#define KV_SIZE(kv, bf16) ((kv) ? 1 : ELEM_SIZE(bf16))

/* dst[0..dim) = the 8-bit vector at p (format kv 1-3) in fp32; one loop per format */
INLINE void widen(const void *p, int dim, int kv, float *dst)
{
    const int8_t *i8 = p;
    const uint8_t *u8 = p;
    if (kv == 1)
        for (int d = 0; d < dim; d++) dst[d] = (float)i8[d];
    else {
        const float *table = kv == 2 ? fp8_e4m3_values : fp8_e5m2_values;
        for (int d = 0; d < dim; d++) dst[d] = table[u8[d]];
    }
}

/* ---------------------------------------------------------------- the portable loop
 * A row is one unit of work. Its blocks are visited once, in order, with an online softmax (running max and
 * sum per head, as flash-decoding does), and the next block is prefetched while this one is used. Each score is
 * one dot product reduced on its own, and each query head widens its K/V again: about 3.5 GB/s of KV on an
 * AVX-512 core, bound by that arithmetic, which is what the vector form removes.
 */
static inline __attribute__((always_inline)) void
decode_row(const float *q, const void *k_cache, const void *v_cache, const float *k_scale, const float *v_scale,
           const int32_t *table, int len, int heads, int kv_heads, const int dim, int block_size, float scale,
           int window, float softcap, float *scratch, float *out, const int bf16, const int quantized, int kv)
{
    kv = quantized ? kv : 0;     /* quantized: a compile-time constant, kv the format (run time) */
    const int group = heads / kv_heads;
    const int64_t token_stride = (int64_t)kv_heads * dim, block_elems = (int64_t)block_size * token_stride;
    const int64_t block_bytes = block_elems * KV_SIZE(kv, bf16);
    float widened[dim];     /* one quantized K or V vector in fp32 */
    float *scores = scratch, *running_max = scratch + (int64_t)heads * block_size, *running_sum = running_max + heads;
    memset(out, 0, sizeof(float) * heads * dim);
    for (int h = 0; h < heads; h++) {
        running_max[h] = -FLT_MAX;
        running_sum[h] = 0.f;
    }
    const int blocks = (len + block_size - 1) / block_size;
    const int first = window > 0 && len > window ? len - window : 0;     /* first visible position */
    for (int b = first / block_size; b < blocks; b++) {
        const void *k_block = (const char *)k_cache + table[b] * block_bytes;
        const void *v_block = (const char *)v_cache + table[b] * block_bytes;
        const int64_t scale_row = (int64_t)table[b] * block_size * kv_heads;      /* the block's first scale */
        const int n = len - b * block_size < block_size ? len - b * block_size : block_size;
        const int skip = first > b * block_size ? first - b * block_size : 0;     /* before the window */
        if (b + 1 < blocks) {
            const char *next_k = (const char *)k_cache + table[b + 1] * block_bytes;
            const char *next_v = (const char *)v_cache + table[b + 1] * block_bytes;
            for (int64_t byte = 0; byte < block_bytes; byte += 64) {
                __builtin_prefetch(next_k + byte);
                __builtin_prefetch(next_v + byte);
            }
        }
        for (int i = skip; i < n; i++) {       /* scores[h][i] = scale * <q_h, k_i> */
            for (int head = 0; head < kv_heads; head++) {
                const int64_t k = i * token_stride + head * dim;
                float head_scale = scale;
                if (quantized) {
                    widen((const int8_t *)k_block + k, dim, kv, widened);
                    head_scale *= k_scale[scale_row + (int64_t)i * kv_heads + head];
                }
                for (int h = head * group; h < (head + 1) * group; h++) {
                    const float *qh = q + (int64_t)h * dim;
                    float dot = 0.f;
                    if (quantized)
                        for (int d = 0; d < dim; d++) dot += qh[d] * widened[d];
                    else
                        for (int d = 0; d < dim; d++) dot += qh[d] * load(k_block, k + d, bf16);
                    scores[h * block_size + i] = softcap > 0.f ? softcap * tanhf(dot * head_scale / softcap)
                                                               : dot * head_scale;
                }
            }
        }
        for (int h = 0; h < heads; h++) {      /* fold the block into the running softmax */
            float *s = scores + h * block_size, block_max = running_max[h], sum = 0.f;
            for (int i = skip; i < n; i++) block_max = s[i] > block_max ? s[i] : block_max;
            const float rescale = expf(running_max[h] - block_max);
            for (int i = skip; i < n; i++) {
                s[i] = expf(s[i] - block_max);
                sum += s[i];
            }
            running_sum[h] = running_sum[h] * rescale + sum;
            running_max[h] = block_max;
            float *o = out + (int64_t)h * dim;
            for (int d = 0; d < dim; d++) o[d] *= rescale;
        }
        for (int i = skip; i < n; i++) {       /* out[h] += p[h][i] * v_i */
            for (int head = 0; head < kv_heads; head++) {
                const int64_t v = i * token_stride + head * dim;
                const float head_scale = quantized ? v_scale[scale_row + (int64_t)i * kv_heads + head] : 1.f;
                if (quantized)
                    widen((const int8_t *)v_block + v, dim, kv, widened);
                for (int h = head * group; h < (head + 1) * group; h++) {
                    const float p = scores[h * block_size + i] * head_scale;
                    float *o = out + (int64_t)h * dim;
                    if (quantized)
                        for (int d = 0; d < dim; d++) o[d] += p * widened[d];
                    else
                        for (int d = 0; d < dim; d++) o[d] += p * load(v_block, v + d, bf16);
                }
            }
        }
    }
    for (int h = 0; h < heads && len > 0; h++) {
        const float inv = 1.f / running_sum[h];
        for (int d = 0; d < dim; d++) out[(int64_t)h * dim + d] *= inv;
    }
}

int paged_decode_available_simd(void)     /* 1 where this build has the vector form */
{
    return paged_decode_simd(NULL, NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL, 0, 1, 1, 64, 16, 1.f, 0, 0.f, 0, 0)
           != DECODE_NO_SIMD;
}

int paged_decode(const void *q, const void *k_cache, const void *v_cache, const float *k_scale,
                 const float *v_scale, const int32_t *tables, int64_t table_stride, const int32_t *lens, void *out,
                 int rows, int heads, int kv_heads, int dim, int block_size, float scale, int window, float softcap,
                 int bf16, int kv, int portable)
{
    if (!portable) {
        const int done = paged_decode_simd(q, k_cache, v_cache, k_scale, v_scale, tables, table_stride, lens, out,
                                           rows, heads, kv_heads, dim, block_size, scale, window, softcap, bf16, kv);
        if (done != DECODE_NO_SIMD) return done;
    }
    int failed = 0;
    const int64_t row_elems = (int64_t)heads * dim;
    #pragma omp parallel if (rows > 1)
    {
        /* scores, running max and sum, then the row's query and its output accumulator in fp32 */
        float *scratch = malloc(sizeof(float) * ((size_t)heads * block_size + 2 * (size_t)heads + 2 * row_elems));
        /* every thread must reach the worksharing loop, so a thread without scratch only reports it */
        #pragma omp for schedule(dynamic, 1)
        for (int r = 0; r < rows; r++) {
            if (!scratch) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            float *qr = scratch + (int64_t)heads * block_size + 2 * heads, *acc = qr + row_elems;
            for (int64_t e = 0; e < row_elems; e++) qr[e] = load(q, r * row_elems + e, bf16);
            const int32_t *table = tables + (int64_t)r * table_stride;
            /* head_dim and dtypes as compile-time constants in the common cases, so the inner loops unroll */
#define DECODE_ROW(DIM, BF16, QUANTIZED) decode_row(qr, k_cache, v_cache, k_scale, v_scale, table, lens[r], heads, \
                                                    kv_heads, DIM, block_size, scale, window, softcap, scratch, acc, \
                                                    BF16, QUANTIZED, kv)
#define DECODE_KV(DIM)                                                       \
            if (kv) DECODE_ROW(DIM, 0, 1);                                   \
            else if (bf16) DECODE_ROW(DIM, 1, 0);                            \
            else DECODE_ROW(DIM, 0, 0)
            switch (dim) {
            case 64: DECODE_KV(64); break;
            case 128: DECODE_KV(128); break;
            case 32: DECODE_KV(32); break;
            default: DECODE_KV(dim);
            }
#undef DECODE_KV
#undef DECODE_ROW
            for (int64_t e = 0; e < row_elems; e++) store(out, r * row_elems + e, acc[e], bf16);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
