/* Paged decode attention in AVX-512: decode_attn.c's paged_decode with the same arguments and the same math (fp32
 * products and sums, the per-token scales of a quantized cache applied to the score and to the probability, an
 * online softmax), in another order of fp32 additions; over an int8 cache the scores are integer dot products of
 * the query rounded to int16 (see quantize_query). head_dim one of 32, 64, 128, 256; else DECODE_NO_SIMD.
 *
 * A unit of work is a row (or one KV head of a row, where rows are fewer than threads); the query heads of a KV
 * head (GQA's group) share every K/V vector read. A row's visible tokens go by chunks of up to 16 keys of one block,
 * and by spans of up to 4 chunks (64 keys, from one or several blocks); per span and KV head:
 *   1. each chunk's K vectors of the head are widened once into a tile: fp32 (fp8 by its bits, bf16 by a shift
 *      where the CPU lacks AVX-512 BF16; with it bf16 keys are read in place), or int16 for int8; the quantized
 *      scales beside them (one masked gather each);
 *   2. per query head, 16 partial-product vectors (one per key: head_dim / 16 FMAs, or head_dim / 32 pair
 *      products, int16 or bf16) are reduced by a transpose-add tree into one vector of 16 scores, instead of 16
 *      horizontal sums;
 *   3. the online softmax takes the span's scores at once (one max, one exp of 16 lanes a chunk, one sum, one
 *      rescale of the outputs): taken per chunk it was a quarter of the time;
 *   4. each V vector is widened once, in place (fp8's, a dozen instructions, through a tile), for up to 4 query
 *      heads, whose outputs stay in registers for the chunk.
 * The block two ahead (past a row's end: the next row's) is prefetched while one is used, a KV head's lines at a
 * time, with its scales: blocks sit at random places in a large pool, and at 32 rows of a few hundred tokens the KV
 * bytes a step reads are as many as the weights'. K's lines are fetched before the scores, V's before V's pass
 * (both before the scores, in one burst, was 1.2x slower; 4 or 6 blocks ahead no faster than 2 at two threads).
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_attn.h"
#include "dtypes.h"
#include "simd.h"

#if defined(__AVX512BW__)

#define CHUNK 16
#define MAX_GROUP_BLOCK 4      /* query heads whose outputs one pass over V's tile keeps in registers */
#define SPAN 4                 /* chunks whose scores take one step of the online softmax */

typedef struct {     /* a chunk of a row's keys: up to CHUNK of one block */
    const char *kb, *vb;       /* its block's K and V */
    int64_t fetch;             /* the block whose lines are prefetched meanwhile, or -1 */
    int64_t scale_row;         /* (block * block_size + i0) * kv_heads: its first key's scales, KV head 0 */
    int i0, cnt;               /* its first key in the block, its keys */
} Chunk;

enum { KV_F32, KV_BF16, KV_INT8, KV_E4M3, KV_E5M2 };     /* cache formats, compile-time constants below */

/* 16 consecutive values of a cache in `format` from element e, in fp32 */
INLINE __m512 widen16(const void *p, int64_t e, const int format)
{
    if (format == KV_F32) return _mm512_loadu_ps((const float *)p + e);
    if (format == KV_BF16) return from_bf16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + e)));
    const __m128i bytes = _mm_loadu_si128((const __m128i *)((const uint8_t *)p + e));
    if (format == KV_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    /* fp8 by its bits, as kv_fp8_e4m3 / kv_fp8_e5m2 hold it: a normal code's exponent and mantissa moved into
     * fp32's with the bias changed (e4m3: 7 -> 127, e5m2: 15 -> 127), a subnormal one (exponent 0) as its mantissa
     * times 2^-9 / 2^-16 (no fp32 subnormal is made, so flush-to-zero cannot touch it), NaN and inf codes 0 */
    const __m512i b = _mm512_cvtepu8_epi32(bytes), mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    const int e4m3 = format == KV_E4M3;
    const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, e4m3 ? 20 : 21),
                                                               _mm512_set1_epi32((e4m3 ? 120 : 112) << 23)));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(e4m3 ? 0x1p-9f : 0x1p-16f));
    __m512 x = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(e4m3 ? 8 : 4)), normal, sub);
    x = _mm512_maskz_mov_ps(e4m3 ? _mm512_cmpneq_epi32_mask(mag, _mm512_set1_epi32(0x7f))
                                 : _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(0x7c)), x);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign));
}

/* e^x lane by lane for x <= 0, within about an ulp: 2^n * e^r with |r| <= ln2 / 2 (Taylor to r^7); below -87
 * (weights under 1e-38 of the largest) clamped there */
INLINE __m512 exp16(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);       /* ln2 in two parts */
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    static const float taylor[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
    for (int k = 0; k < 7; k++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(taylor[k]));
    return _mm512_scalef_ps(p, n);
}

/* lane i = the sum of v[i]'s 16 lanes (fp32, or int32 where integer != 0): pairs of vectors interleaved and added
 * within 128-bit lanes (16 -> 8 -> 4), then 128-bit lanes exchanged and added (4 -> 2 -> 1); 45 instructions for
 * what 16 reductions do in ~150 */
INLINE __m512 add16(__m512 a, __m512 b, const int integer)
{
    return integer ? _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)))
                   : _mm512_add_ps(a, b);
}

INLINE __m512 sum16(const __m512 *v, const int integer)
{
    __m512 t[8], u[4], y[2];
    for (int j = 0; j < 8; j++)         /* per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 */
        t[j] = add16(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]), integer);
    for (int j = 0; j < 4; j++)         /* per 128-bit lane: the lane's sums of 4 keys */
        u[j] = add16(_mm512_shuffle_ps(t[2 * j], t[2 * j + 1], 0x44), _mm512_shuffle_ps(t[2 * j], t[2 * j + 1], 0xee),
                     integer);
    for (int j = 0; j < 2; j++)         /* 128-bit lanes 0+1 and 2+3 of two vectors */
        y[j] = add16(_mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0x88),
                     _mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0xdd), integer);
    return add16(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd), integer);
}

/* 16 scores (unscaled) of the query at qf against the fp32 key tile kt (16 keys of dim): per key, head_dim / 16
 * FMAs into a vector of partial products, the 16 vectors reduced by sum16 */
INLINE __m512 float_scores(const float *qf, const float *kt, const int dim)
{
    __m512 part[CHUNK];
    #pragma GCC unroll 16
    for (int i = 0; i < CHUNK; i++) {
        __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qf), _mm512_loadu_ps(kt + i * dim));
        #pragma GCC unroll 16
        for (int c = 16; c < dim; c += 16)
            dot = _mm512_fmadd_ps(_mm512_loadu_ps(qf + c), _mm512_loadu_ps(kt + i * dim + c), dot);
        part[i] = dot;
    }
    return sum16(part, 0);
}

/* An int8 cache's scores in integers: each query head's vector as int16 with a power-of-two scale of its own (its
 * largest value in [2^14, 2^15): q times the inverse scale is exact, ties round to even), each key widened to
 * int16, their products summed in int32 by pairs (VNNI's vpdpwssd, else vpmaddwd and an add); exact but for the
 * query's rounding, 2^-15 of its largest value at most: below a bf16 query's own. */
INLINE float quantize_query(const float *qf, int16_t *q16, const int dim)     /* returns the scale */
{
    __m512 top = _mm512_setzero_ps();
    for (int c = 0; c < dim; c += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(qf + c)));
    int e;
    frexpf(_mm512_reduce_max_ps(top), &e);            /* max < 2^e */
    const __m512 inv = _mm512_set1_ps(ldexpf(1.f, 15 - e));
    for (int c = 0; c < dim; c += 16)                 /* saturating: a max rounded up to 2^15 stays 32767 */
        _mm256_storeu_si256((__m256i *)(q16 + c), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(
                                                      _mm512_mul_ps(_mm512_loadu_ps(qf + c), inv))));
    return ldexpf(1.f, e - 15);
}

INLINE __m512i dot16(__m512i acc, __m512i a, __m512i b)    /* acc + pairwise sums of a * b (int16 -> int32) */
{
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* 16 int32 scores of the query at q16 against the int16 key tile kt16 (16 keys of dim), as fp32 */
INLINE __m512 int_scores(const int16_t *q16, const int16_t *kt16, const int dim)
{
    __m512 part[CHUNK];
    #pragma GCC unroll 16
    for (int i = 0; i < CHUNK; i++) {
        __m512i dot = _mm512_setzero_si512();
        #pragma GCC unroll 8
        for (int c = 0; c < dim; c += 32)
            dot = dot16(dot, _mm512_loadu_si512(q16 + c), _mm512_loadu_si512(kt16 + i * dim + c));
        part[i] = _mm512_castsi512_ps(dot);
    }
    return _mm512_cvtepi32_ps(_mm512_castps_si512(sum16(part, 1)));
}

#if defined(__AVX512BF16__)
#define BF16_SCORES 1
/* 16 scores (unscaled) of the bf16 query at qb (read where the caller holds it) against cnt bf16 keys read in
 * place from element e of kb (token stride token_stride): vdpbf16ps multiplies pairs exactly and sums them in fp32,
 * so no tile is filled; keys past cnt are not read (a masked load) and score 0 */
INLINE __m512 bf16_scores(const uint16_t *qb, const char *kb, int64_t e, int64_t token_stride, int cnt,
                          const int dim)
{
    const uint16_t *k = (const uint16_t *)kb + e;
    __m512 part[CHUNK];
    #pragma GCC unroll 16
    for (int i = 0; i < CHUNK; i++) {
        const __mmask32 keep = i < cnt ? ~(__mmask32)0 : 0;
        __m512 dot = _mm512_setzero_ps();
        #pragma GCC unroll 8
        for (int c = 0; c < dim; c += 32)
            dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(qb + c),
                                   (__m512bh)_mm512_maskz_loadu_epi16(keep, k + i * token_stride + c));
        part[i] = dot;
    }
    return sum16(part, 0);
}
#else
#define BF16_SCORES 0
#endif

/* The int16 key tile of cnt int8 keys from element e of kb (token stride token_stride); rows past cnt zero */
INLINE void fill_int16_tile(const char *kb, int64_t e, int64_t token_stride, int cnt, const int dim, int16_t *kt16)
{
    for (int i = 0; i < cnt; i++, e += token_stride)
        #pragma GCC unroll 8
        for (int c = 0; c < dim; c += 32)
            _mm512_storeu_si512(kt16 + i * dim + c,
                                _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(kb + e + c))));
    if (cnt < CHUNK) memset(kt16 + cnt * dim, 0, sizeof(int16_t) * (CHUNK - cnt) * dim);
}

INLINE __m512 soft_cap(__m512 s, float cap)      /* cap * tanh(s / cap), lane by lane (Gemma 2's layers) */
{
    float lanes[CHUNK];
    _mm512_storeu_ps(lanes, s);
    for (int i = 0; i < CHUNK; i++) lanes[i] = cap * tanhf(lanes[i] / cap);
    return _mm512_loadu_ps(lanes);
}

/* acc[g] = acc[g] * rescale[g] (rescale NULL: 1) + sum over the chunk's keys i of p[g * CHUNK + i] * v_i, for gb
 * query heads at once; v_i widened from element e + i * stride of v in `format` (the cache itself, or for fp8 the
 * chunk's fp32 tile) */
INLINE void accumulate(float *acc, const float *p, const float *rescale, const void *v, int64_t e, int64_t stride,
                       int cnt, const int dim, const int gb, const int format)
{
    __m512 a[MAX_GROUP_BLOCK][16];
    #pragma GCC unroll 4
    for (int g = 0; g < gb; g++)
        #pragma GCC unroll 16
        for (int c = 0; c < dim / 16; c++) {
            a[g][c] = _mm512_loadu_ps(acc + g * dim + 16 * c);
            if (rescale) a[g][c] = _mm512_mul_ps(a[g][c], _mm512_set1_ps(rescale[g]));
        }
    for (int i = 0; i < cnt; i++, e += stride) {
        #pragma GCC unroll 16
        for (int c = 0; c < dim / 16; c++) {
            const __m512 x = widen16(v, e + 16 * c, format);
            #pragma GCC unroll 4
            for (int g = 0; g < gb; g++) a[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * CHUNK + i]), x, a[g][c]);
        }
    }
    #pragma GCC unroll 4
    for (int g = 0; g < gb; g++)
        #pragma GCC unroll 16
        for (int c = 0; c < dim / 16; c++) _mm512_storeu_ps(acc + g * dim + 16 * c, a[g][c]);
}

/* accumulate() for gb (1-4) and the formats whose V is read in place (fp32, bf16, int8: a widen of one or two
 * instructions) or from the fp32 tile (fp8, whose widen is a dozen) */
INLINE void accumulate_any(float *acc, const float *p, const float *rescale, const char *vb, const float *vt,
                           int64_t e, int64_t stride, int cnt, const int dim, int gb, int format)
{
#define ACC(GB, FMT, V, E, S) accumulate(acc, p, rescale, V, E, S, cnt, dim, GB, FMT)
#define ACC_GB(FMT, V, E, S) do { if (gb == 4) ACC(4, FMT, V, E, S); else if (gb == 3) ACC(3, FMT, V, E, S); \
                                  else if (gb == 2) ACC(2, FMT, V, E, S); else ACC(1, FMT, V, E, S); } while (0)
    switch (format) {
    case KV_F32: ACC_GB(KV_F32, vb, e, stride); break;
    case KV_BF16: ACC_GB(KV_BF16, vb, e, stride); break;
    case KV_INT8: ACC_GB(KV_INT8, vb, e, stride); break;
    default: ACC_GB(KV_F32, vt, 0, dim);
    }
#undef ACC_GB
#undef ACC
}

/* Per thread: a K tile and a span's V tiles, then per query head of the item: query, output, the span's scores
 * and softmax weights, running max, sum and the span's rescale, and for an int8 cache the query in int16 and its
 * scale. */
#define SCRATCH_FLOATS(dim, heads) ((1 + SPAN) * CHUNK * (size_t)(dim) \
                                    + (size_t)(heads) * (5 * (dim) / 2 + SPAN * CHUNK + 4))
#define PREFETCH_BLOCKS 2      /* how far ahead a row's blocks are fetched */

/* bytes from p into L2: the hint T1, as the linear kernels (into L1 was 20-35% slower on an AMD EPYC, NTA too) */
INLINE void prefetch_lines(const void *p, int64_t bytes)
{
    for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch((const char *)p + byte, 0, 2);
}

/* Rows [0, block_size) of KV heads [h0, h1) of one block, K and V */
INLINE void prefetch_block(const char *k, const char *v, int block_size, int64_t token_bytes, int64_t head_bytes,
                           int h0, int h1)
{
    for (int t = 0; t < block_size; t++) {
        prefetch_lines(k + t * token_bytes + h0 * head_bytes, (h1 - h0) * head_bytes);
        prefetch_lines(v + t * token_bytes + h0 * head_bytes, (h1 - h0) * head_bytes);
    }
}

/* The tiles of cnt keys from element e of blocks kb, vb (one KV head, token stride token_stride), in fp32: K's
 * (rows past cnt zero: they score 0 and weigh 0), and V's only for fp8 (other formats' V is widened in place) */
INLINE void fill_tiles(const char *kb, const char *vb, int64_t e, int64_t token_stride, int cnt, const int dim,
                       const int format, float *kt, float *vt)
{
    for (int i = 0; i < cnt; i++, e += token_stride)
        #pragma GCC unroll 16
        for (int c = 0; c < dim; c += 16) {
            _mm512_storeu_ps(kt + i * dim + c, widen16(kb, e + c, format));
            if (format >= KV_E4M3) _mm512_storeu_ps(vt + i * dim + c, widen16(vb, e + c, format));
        }
    if (cnt < CHUNK) memset(kt + cnt * dim, 0, sizeof(float) * (CHUNK - cnt) * dim);
}

/* One row's KV heads [h0, h1): out's query heads of those from q's, over the row's visible tokens. next_table,
 * next_len: the next row's (NULL: none), whose first blocks are prefetched at this one's end. */
INLINE void decode_heads(const void *q, const void *k_cache, const void *v_cache, const float *k_scale,
                         const float *v_scale, const int32_t *table, int len, const int32_t *next_table,
                         int next_len, int h0, int h1, int group, int kv_heads, const int dim, int block_size,
                         float scale, int window, float softcap, float *scratch, void *out, int bf16, int format)
{
    const int quantized = format >= KV_INT8, gmax = dim <= 64 ? 4 : dim == 128 ? 2 : 1, heads = (h1 - h0) * group;
    const int64_t token_stride = (int64_t)kv_heads * dim;
    const int64_t kv_size = format == KV_F32 ? 4 : format == KV_BF16 ? 2 : 1, head_bytes = dim * kv_size;
    const int64_t block_bytes = (int64_t)block_size * token_stride * kv_size;
    float *kt = scratch, *vt = kt + CHUNK * dim;
    float *qf = vt + SPAN * CHUNK * dim, *acc = qf + heads * dim, *p = acc + heads * dim;
    float *m = p + SPAN * heads * CHUNK;
    float *l = m + heads, *rescale = l + heads, *qs = rescale + heads;
    int16_t *q16 = (int16_t *)(qs + heads), *kt16 = (int16_t *)kt;
    for (int e = 0; e < heads * dim; e++) {
        qf[e] = load(q, (int64_t)h0 * group * dim + e, bf16);
        acc[e] = 0.f;
    }
    for (int g = 0; g < heads; g++) {
        m[g] = -FLT_MAX;
        l[g] = 0.f;
        if (format == KV_INT8) qs[g] = quantize_query(qf + g * dim, q16 + g * dim, dim);
    }
    const __m512i strided = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(kv_heads));     /* a chunk's scales, per key */
    const int blocks = (len + block_size - 1) / block_size;
    const int next_blocks = next_table ? (next_len + block_size - 1) / block_size : 0;
    const int first = window > 0 && len > window ? len - window : 0;     /* first visible position */
    int b = first / block_size, i0 = first - b * block_size, entering = 1;     /* entering: a block's first chunk */
    /* prefetch: the row's next blocks at its start; then, spread over each block's chunks and KV heads below (a
     * block at once was up to 1.25x slower: the fetches come in one burst), the block PREFETCH_BLOCKS ahead, or past
     * the row's end the next row's first (its thread is likely this one), and that block's scales with the block's
     * first chunk */
    for (int ahead = 1; ahead < PREFETCH_BLOCKS && b + ahead < blocks; ahead++)
        prefetch_block((const char *)k_cache + table[b + ahead] * block_bytes,
                       (const char *)v_cache + table[b + ahead] * block_bytes, block_size, token_stride * kv_size,
                       head_bytes, h0, h1);
    while (b < blocks) {
        Chunk ch[SPAN];       /* the span: up to SPAN chunks of the row, in order, from one or more blocks */
        int nc = 0;
        for (; nc < SPAN && b < blocks; nc++) {
            Chunk *c = ch + nc;
            const int n = len - b * block_size < block_size ? len - b * block_size : block_size;
            c->kb = (const char *)k_cache + table[b] * block_bytes;
            c->vb = (const char *)v_cache + table[b] * block_bytes;
            c->cnt = n - i0 < CHUNK ? n - i0 : CHUNK;
            c->i0 = i0;
            c->scale_row = ((int64_t)table[b] * block_size + i0) * kv_heads;
            const int later = b + PREFETCH_BLOCKS;
            c->fetch = later < blocks ? table[later] : later - blocks < next_blocks ? next_table[later - blocks] : -1;
            if (entering && c->fetch >= 0 && quantized) {
                prefetch_lines(k_scale + c->fetch * block_size * kv_heads,
                               block_size * kv_heads * (int64_t)sizeof(float));
                prefetch_lines(v_scale + c->fetch * block_size * kv_heads,
                               block_size * kv_heads * (int64_t)sizeof(float));
            }
            i0 += c->cnt;
            entering = i0 >= n;
            if (entering) {
                b++;
                i0 = 0;
            }
        }
        for (int head = h0; head < h1; head++) {
            const int g0 = (head - h0) * group;
            __m512 vs[SPAN];
            __mmask16 valid[SPAN];
            for (int k = 0; k < nc; k++) {      /* 1, 2. each chunk's tiles and its scores, per query head */
                const Chunk *c = ch + k;
                const int cnt = c->cnt;
                valid[k] = (__mmask16)((1u << cnt) - 1);
                const int64_t e = (int64_t)c->i0 * token_stride + (int64_t)head * dim;
                if (c->fetch >= 0)
                    for (int i = 0; i < cnt; i++)
                        prefetch_lines((const char *)k_cache + c->fetch * block_bytes
                                       + (e + (int64_t)i * token_stride) * kv_size, head_bytes);
                float *vtk = vt + k * CHUNK * dim;
                switch (format) {
                case KV_F32: fill_tiles(c->kb, c->vb, e, token_stride, cnt, dim, KV_F32, kt, vtk); break;
                case KV_BF16: if (!BF16_SCORES) fill_tiles(c->kb, c->vb, e, token_stride, cnt, dim, KV_BF16, kt, vtk);
                              break;
                case KV_INT8: fill_int16_tile(c->kb, e, token_stride, cnt, dim, kt16); break;
                case KV_E4M3: fill_tiles(c->kb, c->vb, e, token_stride, cnt, dim, KV_E4M3, kt, vtk); break;
                default: fill_tiles(c->kb, c->vb, e, token_stride, cnt, dim, KV_E5M2, kt, vtk);
                }
                /* the chunk's scales: every kv_heads-th float from its row, lanes past cnt 0 */
                const int64_t scale_row = c->scale_row + head;
                const __m512 ks = quantized ? _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid[k], strided,
                                                                       k_scale + scale_row, 4) : _mm512_setzero_ps();
                vs[k] = quantized ? _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid[k], strided,
                                                             v_scale + scale_row, 4) : _mm512_setzero_ps();
                const __m512 key_scale = quantized ? _mm512_mul_ps(_mm512_set1_ps(scale), ks) : _mm512_set1_ps(scale);
                for (int g = g0; g < g0 + group; g++) {
                    __m512 sc;
                    if (format == KV_INT8)
                        sc = _mm512_mul_ps(int_scores(q16 + g * dim, kt16, dim),
                                           _mm512_mul_ps(key_scale, _mm512_set1_ps(qs[g])));
#if BF16_SCORES
                    else if (format == KV_BF16)
                        sc = _mm512_mul_ps(bf16_scores((const uint16_t *)q + (int64_t)h0 * group * dim + g * dim,
                                                       c->kb, e, token_stride, cnt, dim), key_scale);
#endif
                    else
                        sc = _mm512_mul_ps(float_scores(qf + g * dim, kt, dim), key_scale);
                    if (softcap > 0.f) sc = soft_cap(sc, softcap);
                    _mm512_storeu_ps(p + ((int64_t)k * heads + g) * CHUNK, sc);
                }
            }
            for (int g = g0; g < g0 + group; g++) {     /* 3. the online softmax, once for the span */
                __m512 top = _mm512_set1_ps(-FLT_MAX);
                for (int k = 0; k < nc; k++)
                    top = _mm512_mask_max_ps(top, valid[k], top, _mm512_loadu_ps(p + ((int64_t)k * heads + g) * CHUNK));
                const float span_max = _mm512_reduce_max_ps(top), new_max = span_max > m[g] ? span_max : m[g];
                __m512 sum = _mm512_setzero_ps();
                for (int k = 0; k < nc; k++) {
                    float *pk = p + ((int64_t)k * heads + g) * CHUNK;
                    const __m512 w = _mm512_maskz_mov_ps(valid[k], exp16(_mm512_sub_ps(_mm512_loadu_ps(pk),
                                                                                       _mm512_set1_ps(new_max))));
                    sum = _mm512_add_ps(sum, w);
                    _mm512_storeu_ps(pk, quantized ? _mm512_mul_ps(w, vs[k]) : w);
                }
                rescale[g] = expf(m[g] - new_max);
                l[g] = l[g] * rescale[g] + _mm512_reduce_add_ps(sum);
                m[g] = new_max;
            }
            for (int k = 0; k < nc; k++) {      /* 4. V, shared by up to gmax query heads */
                const Chunk *c = ch + k;
                const int64_t e = (int64_t)c->i0 * token_stride + (int64_t)head * dim;
                if (c->fetch >= 0)
                    for (int i = 0; i < c->cnt; i++)
                        prefetch_lines((const char *)v_cache + c->fetch * block_bytes
                                       + (e + (int64_t)i * token_stride) * kv_size, head_bytes);
                for (int g = g0; g < g0 + group; g += gmax) {
                    const int gb = g0 + group - g < gmax ? g0 + group - g : gmax;
                    accumulate_any(acc + g * dim, p + ((int64_t)k * heads + g) * CHUNK, k ? NULL : rescale + g,
                                   c->vb, vt + k * CHUNK * dim, e, token_stride, c->cnt, dim, gb, format);
                }
            }
        }
    }
    for (int g = 0; g < heads; g++) {
        const float inv = len > 0 ? 1.f / l[g] : 0.f;     /* a row of no tokens attends to nothing: zeros */
        for (int d = 0; d < dim; d++) store(out, (int64_t)(h0 * group + g) * dim + d, acc[g * dim + d] * inv, bf16);
    }
}

int paged_decode_simd(const void *q, const void *k_cache, const void *v_cache, const float *k_scale,
                      const float *v_scale, const int32_t *tables, int64_t table_stride, const int32_t *lens,
                      void *out, int rows, int heads, int kv_heads, int dim, int block_size, float scale, int window,
                      float softcap, int bf16, int kv)
{
    if (dim != 32 && dim != 64 && dim != 128 && dim != 256) return DECODE_NO_SIMD;
    const int group = heads / kv_heads, format = kv ? KV_INT8 + kv - 1 : bf16 ? KV_BF16 : KV_F32;
    /* whole rows (each block read in one sweep), or a KV head each where rows are fewer than threads */
    const int split = rows < omp_get_max_threads() ? kv_heads : 1, span = kv_heads / split;
    const int64_t items = (int64_t)rows * split, row_elems = (int64_t)heads * dim;
    int failed = 0;
    #pragma omp parallel if (items > 1)
    {
        float *scratch = malloc(sizeof(float) * SCRATCH_FLOATS(dim, span * group));
        /* every thread must reach the worksharing loop, so a thread without scratch only reports it */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!scratch) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            const int r = (int)(item / split), h0 = (int)(item % split) * span;
            const void *qr = AT(q, r * row_elems, bf16);
            void *o = AT(out, r * row_elems, bf16);
            const int32_t *table = tables + (int64_t)r * table_stride;
            const int32_t *next = split == 1 && r + 1 < rows ? table + table_stride : NULL;    /* whole rows */
            const int next_len = next ? lens[r + 1] : 0;
#define HEADS(DIM) decode_heads(qr, k_cache, v_cache, k_scale, v_scale, table, lens[r], next, next_len, h0, \
                                h0 + span, group, kv_heads, DIM, block_size, scale, window, softcap, scratch, o, \
                                bf16, format)
            switch (dim) {      /* head_dim a compile-time constant: the inner loops unroll */
            case 64: HEADS(64); break;
            case 128: HEADS(128); break;
            case 32: HEADS(32); break;
            default: HEADS(256);
            }
#undef HEADS
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

#else

int paged_decode_simd(const void *q, const void *k_cache, const void *v_cache, const float *k_scale,
                      const float *v_scale, const int32_t *tables, int64_t table_stride, const int32_t *lens,
                      void *out, int rows, int heads, int kv_heads, int dim, int block_size, float scale, int window,
                      float softcap, int bf16, int kv)
{
    return DECODE_NO_SIMD;
}

#endif
