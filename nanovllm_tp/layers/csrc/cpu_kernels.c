/* fp32 and bf16 CPU kernels for the layers whose torch form is a chain of small ops (each a separate pass over memory
 * and a few microseconds of dispatch): paged decode attention, RMSNorm (with the residual add fused in),
 * neox RoPE and SiLU-and-mul. The sampler's kernels are in sampler.c; both are built into one library and loaded
 * with ctypes by nanovllm_tp/layers/cpu_kernels.py.
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

/* ---------------------------------------------------------------- dtypes
 * Every kernel takes its float tensors as fp32 or, with bf16 != 0, as bf16 (the top half of an fp32), and
 * computes in fp32. The generic bodies are always inlined with bf16 a constant, so each dtype gets its own
 * vectorised loop; bf16 is widened by a shift and rounded to nearest even on the way back.
 */
#define ELEM_SIZE(bf16) ((bf16) ? 2 : 4)
#define AT(p, i, bf16) ((char *)(p) + (int64_t)(i) * ELEM_SIZE(bf16))
#define INLINE static inline __attribute__((always_inline))

INLINE float load(const void *p, int64_t i, const int bf16)
{
    if (!bf16) return ((const float *)p)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE void store(void *p, int64_t i, float f, const int bf16)
{
    if (!bf16) {
        ((float *)p)[i] = f;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    ((uint16_t *)p)[i] = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* ---------------------------------------------------------------- quantized KV values
 * A quantized KV cache (kv_cache_dtype, layers/attention/kv_quant.py) holds 8-bit values, each token's vector of
 * one KV head with one fp32 scale: kv 1 = int8, 2 = fp8 e4m3 (torch.float8_e4m3fn), 3 = fp8 e5m2; kv 0 = the
 * query's dtype, unscaled. fp8 is widened through a 256-entry table (its NaN and inf codes, which a scaled store
 * never writes, read as 0).
 */
static float fp8_e4m3[256], fp8_e5m2[256];

__attribute__((constructor)) static void fill_fp8_tables(void)
{
    for (int b = 0; b < 256; b++) {
        const float sign = b & 0x80 ? -1.f : 1.f;
        const int e4 = (b >> 3) & 15, m3 = b & 7, e5 = (b >> 2) & 31, m2 = b & 3;
        fp8_e4m3[b] = e4 == 15 && m3 == 7 ? 0.f
                      : sign * (e4 ? ldexpf(1.f + m3 / 8.f, e4 - 7) : ldexpf(m3 / 8.f, -6));
        fp8_e5m2[b] = e5 == 31 ? 0.f : sign * (e5 ? ldexpf(1.f + m2 / 4.f, e5 - 15) : ldexpf(m2 / 4.f, -14));
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
        const float *table = kv == 2 ? fp8_e4m3 : fp8_e5m2;
        for (int d = 0; d < dim; d++) dst[d] = table[u8[d]];
    }
}

/* int8 store: x [tokens, heads, dim] (token stride x_stride elements, fp32 or bf16), each (token, head) vector
 * quantized into slot slots[t] of cache [slots, heads, dim] int8 with scales [slots, heads] fp32, as
 * kv_quant.quantize does it: scale = absmax / 127, value = x / scale rounded half to even. Built without
 * -ffast-math (whose reciprocals round differently), so the values equal torch's; a function of its own, not
 * inlined into the OpenMP region, whose outlined body would not keep the attribute. readback: x becomes the
 * dequantized values.
 */
__attribute__((noinline, optimize("no-fast-math"))) static float
quantize_int8(void *x, int8_t *dst, int dim, int bf16, int readback)
{
    float absmax = 0.f;
    for (int d = 0; d < dim; d++) {
        const float a = fabsf(load(x, d, bf16));
        absmax = a > absmax ? a : absmax;
    }
    const float scale = absmax / 127.f;
    for (int d = 0; d < dim; d++) {
        float q = scale > 0.f ? nearbyintf(load(x, d, bf16) / scale) : 0.f;
        q = q > 127.f ? 127.f : q < -127.f ? -127.f : q;
        dst[d] = (int8_t)q;
        if (readback) store(x, d, q * scale, bf16);
    }
    return scale;
}

void kv_store_int8(void *x, int64_t x_stride, const int64_t *slots, int8_t *cache, float *scales, int64_t tokens,
                   int heads, int dim, int bf16, int readback)
{
    const int64_t vectors = tokens * heads;
    #pragma omp parallel for if (vectors * dim >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t e = 0; e < vectors; e++) {
        const int64_t t = e / heads, h = e % heads, slot = slots[t] * heads + h;
        scales[slot] = quantize_int8(AT(x, t * x_stride + h * dim, bf16), cache + slot * dim, dim, bf16, readback);
    }
}

/* ---------------------------------------------------------------- paged decode attention
 * One query token per row attends to its K/V in place in the paged cache: nothing is gathered or padded.
 *   q, out   [rows, heads, dim]
 *   k/v      [num_blocks, block_size, kv_heads, dim] in q's dtype (kv 0) or 8-bit (kv 1-3, see above) with
 *   k/v_scale [num_blocks, block_size, kv_heads] fp32: a quantized vector is widened in registers, its scale
 *            applied once to the dot product (K) and to the probability (V)
 *   tables   [rows, table_stride] int32 block ids, lens [rows] int32 context lengths
 * A row is one unit of work. Its blocks are visited once, in order, with an online softmax (running max and
 * sum per head, as flash-decoding does), and the next block is prefetched while this one is used: blocks
 * sit at random places in a large pool, so memory latency, not arithmetic, is what costs.
 * window > 0: the query (at position len - 1) sees only the last `window` tokens; blocks before them are never
 * read (their table entries may be stale). softcap > 0: scores become softcap * tanh(score / softcap).
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

/* q and out in one dtype (fp32, or bf16 when bf16 != 0), the caches in it too (kv 0) or quantized (kv 1-3, with
 * k_scale/v_scale); tables and lens int32. */
int paged_decode(const void *q, const void *k_cache, const void *v_cache, const float *k_scale,
                 const float *v_scale, const int32_t *tables, int64_t table_stride, const int32_t *lens, void *out,
                 int rows, int heads, int kv_heads, int dim, int block_size, float scale, int window, float softcap,
                 int bf16, int kv)
{
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
