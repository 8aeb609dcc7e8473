/* Linear layers over block-quantized weights on CPU: out = x @ w.T (+ bias) where w stays in GGUF's blocks of 32
 * (Q8_0: d * q, q int8; Q4_0: d * (q - 8), q 4 bits; Q4_1: d * q + m, q 4 bits; d and m fp16 per block).
 *
 * The weight is repacked once (pack_q_weight) into units of 32 outputs, two tiles of 16 lanes, so that one
 * 64-byte load holds 4 consecutive k of 16 outputs, the operand layout of VPDPBUSD (u8 x s8, 4 products summed
 * per int32 lane):
 *     quants  [unit][block][tile][group][16 lanes][4 bytes]     Q8_0: 8 groups of q + 128; Q4: 4 groups of the
 *                                                               file's bytes (low nibble k = 4g + i, high 16 + 4g + i)
 *     scales  [unit][block][d fp16 x 32][m fp16 x 32 (Q4_1)]    after every quant
 * The last unit is zero-padded. A thread's units are one contiguous stream, read once per row group.
 *
 * Activations are quantized per row and per block of 32 (as llama.cpp's Q8_0/Q8_1 activation blocks): scale
 * dx = amax * (1/127) in fp32, q = round-half-even(x * (1/dx)), kept beside their sum. Each (output, block) then
 * costs an exact integer dot product of the stored unsigned values u against q, and
 *     y += (dw * dx) * (dot - off * sum(q))        off = 128 (Q8_0, u = q + 128), 8 (Q4_0), 0 (Q4_1)
 *     y += mw * (dx * sum(q))                       Q4_1 only
 * in fp32: the same numbers as dequantizing both operands (layers/quant.py's torch reference does that), summed
 * in another order. I8 (int8 per output channel, layers/quant.py's quantization="int8") stores q + 128 like Q8_0
 * and one fp32 scale per output; its activations take one scale per row, and each output is one integer dot
 * product over all of k, scaled once: (sw * dx) * (dot - 128 * sum(q)). One kernel serves decode (bound by reading
 * the weights) and prefill (chunks of ROWS rows reuse a unit's weights from cache). Without AVX-512 VNNI at
 * compile time linear_q_available() says 0 and the weights are dequantized at load instead.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define UNIT 32
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8,      /* ggml type ids */
       I8 = 100 };                        /* int8 per output channel: rows of [fp32 scale][k int8] (layers/quant.py) */

static int64_t unit_quant_bytes(int qt) { return qt == Q8_0 || qt == I8 ? 1024 : 512; }
static int64_t unit_scale_bytes(int qt) { return qt == Q4_1 ? 128 : qt == I8 ? 0 : 64; }   /* per unit and block */
static int64_t file_block_bytes(int qt) { return qt == Q8_0 ? 34 : qt == Q4_1 ? 20 : 18; }
static int known(int qt) { return qt == Q8_0 || qt == Q4_0 || qt == Q4_1 || qt == I8; }

/* bytes of the packed form of an [n, k] weight, or -1 for a type this file does not know or k not whole blocks;
 * I8 keeps its 32 row scales (fp32) per unit after the quants */
int64_t q_packed_bytes(int64_t n, int64_t k, int qtype)
{
    if (!known(qtype) || k % QK) return -1;
    const int64_t units = (n + UNIT - 1) / UNIT;
    return units * ((k / QK) * (unit_quant_bytes(qtype) + unit_scale_bytes(qtype)) + (qtype == I8 ? 4 * UNIT : 0));
}

/* raw: the file's rows of blocks [n][k / 32] (I8: rows of [fp32 scale][k int8]); packed: q_packed_bytes bytes */
void pack_q_weight(const uint8_t *raw, uint8_t *packed, int64_t n, int64_t k, int qtype)
{
    const int64_t nb = k / QK, units = (n + UNIT - 1) / UNIT, uq = unit_quant_bytes(qtype);
    const int64_t us = unit_scale_bytes(qtype), bb = file_block_bytes(qtype), groups = uq == 1024 ? 8 : 4;
    const int offset = uq == 1024 ? 0x80 : 0;          /* int8 quants are stored as u8 = q + 128 */
    uint8_t *scales = packed + units * nb * uq;
    #pragma omp parallel for schedule(static) if (n * k >= (1 << 20))
    for (int64_t u = 0; u < units; u++)
        for (int64_t b = 0; b < nb; b++)
            for (int lane = 0; lane < UNIT; lane++) {
                const int64_t row = u * UNIT + lane;
                uint8_t *q = packed + (u * nb + b) * uq + (lane / 16) * (uq / 2) + (lane % 16) * 4;
                const uint8_t *qs = NULL;
                if (qtype == I8) {
                    float *row_scales = (float *)(scales + u * 4 * UNIT);
                    row_scales[lane] = 0.f;
                    if (row < n) {
                        memcpy(row_scales + lane, raw + row * (4 + k), 4);
                        qs = raw + row * (4 + k) + 4 + b * QK;
                    }
                } else {
                    const uint8_t *src = row < n ? raw + (row * nb + b) * bb : NULL;
                    uint8_t *s = scales + (u * nb + b) * us;
                    qs = src ? src + (qtype == Q4_1 ? 4 : 2) : NULL;
                    memset(s + 2 * lane, 0, 2);
                    if (src) memcpy(s + 2 * lane, src, 2);
                    if (qtype == Q4_1) {
                        memset(s + 64 + 2 * lane, 0, 2);
                        if (src) memcpy(s + 64 + 2 * lane, src + 2, 2);
                    }
                }
                for (int g = 0; g < groups; g++)
                    for (int i = 0; i < 4; i++)
                        q[g * 64 + i] = (uint8_t)((qs ? qs[4 * g + i] : 0) ^ offset);
            }
}

static float half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) bits = sign | 0x7f800000 | (mant << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (mant << 13);
    else if (!mant) bits = sign;
    else {                                    /* subnormal: normalise */
        int e = -1;
        uint32_t m = mant;
        do { m <<= 1; e++; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void store_float(void *out, int64_t i, float f, int bf16)
{
    if (!bf16) { ((float *)out)[i] = f; return; }
    uint32_t bits;
    memcpy(&bits, &f, 4);
    ((uint16_t *)out)[i] = (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

/* Rows ids[0..count) of a packed weight of a GGUF type (not I8), dequantized (d * q + m in fp32, then the output
 * dtype): the embedding's lookup when the LM head shares its weight. */
void gather_q_rows(const uint8_t *packed, const int64_t *ids, void *out, int64_t count, int64_t n, int64_t k,
                   int qtype, int bf16)
{
    const int64_t nb = k / QK, units = (n + UNIT - 1) / UNIT, uq = unit_quant_bytes(qtype);
    const int64_t us = unit_scale_bytes(qtype);
    const uint8_t *scales = packed + units * nb * uq;
    #pragma omp parallel for schedule(static) if (count * k >= (1 << 16))
    for (int64_t e = 0; e < count; e++) {
        const int64_t row = ids[e], u = row / UNIT, lane = row % UNIT;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *q = packed + (u * nb + b) * uq + (lane / 16) * (uq / 2) + (lane % 16) * 4;
            const uint8_t *s = scales + (u * nb + b) * us;
            uint16_t dh, mh = 0;
            memcpy(&dh, s + 2 * lane, 2);
            if (qtype == Q4_1) memcpy(&mh, s + 64 + 2 * lane, 2);
            const float d = half_to_float(dh), m = half_to_float(mh);
            for (int j = 0; j < QK; j++) {
                float v;
                if (qtype == Q8_0) v = (float)(int8_t)(q[j / 4 * 64 + j % 4] ^ 0x80) * d;
                else {
                    const int jj = j % 16, nib = (q[jj / 4 * 64 + jj % 4] >> (j < 16 ? 0 : 4)) & 0xf;
                    v = qtype == Q4_0 ? (float)(nib - 8) * d : (float)nib * d + m;
                }
                store_float(out, e * k + b * QK + j, v, bf16);
            }
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "simd.h"

#define ROWS 4            /* rows per chunk: 2 x ROWS int and float accumulators stay in registers */
#define GROUP_ROWS 32     /* rows per work unit: the unit's weights stay in L1/L2 across its chunks */
#define PARALLEL_MIN_MACS (1 << 18)
#define INLINE static inline __attribute__((always_inline))

int linear_q_available(void) { return 1; }

static const float INV127 = 1.0f / 127.0f;

INLINE void load32(const void *x, int64_t b, const int bf16, __m512 *v0, __m512 *v1)
{
    if (bf16) {
        const uint16_t *p = (const uint16_t *)x + b * QK;
        *v0 = from_bf16(_mm256_loadu_si256((const __m256i *)p));
        *v1 = from_bf16(_mm256_loadu_si256((const __m256i *)(p + 16)));
    } else {
        *v0 = _mm512_loadu_ps((const float *)x + b * QK);
        *v1 = _mm512_loadu_ps((const float *)x + b * QK + 16);
    }
}

INLINE __m512 abs_max(__m512 v0, __m512 v1) { return _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)); }

/* the scale of values up to amax, and its inverse (0 for 0) */
INLINE float scale_of(float amax, float *inverse)
{
    float d = amax * INV127;
    __asm__("" : "+v"(d));     /* -ffast-math would turn 1 / (amax * c) into (1 / c) / amax: other bits */
    *inverse = d > 0.f ? 1.0f / d : 0.f;
    return d;
}

/* One row of k activations (fp32, or bf16) into int8 q, scaled per block of 32 (dx, off * sum(q), dx * sum(q)
 * per block) or, with whole, by one scale for the row (I8: the three at index 0). */
INLINE void quantize_row(const void *x, const int bf16, int64_t nb, int off, int8_t *q, float *dx, int32_t *c,
                         float *s, const int whole)
{
    __m512 v0, v1, amax = _mm512_setzero_ps();
    float d = 0.f, id = 0.f;
    int32_t total = 0;
    if (whole) {
        for (int64_t b = 0; b < nb; b++) {
            load32(x, b, bf16, &v0, &v1);
            amax = _mm512_max_ps(amax, abs_max(v0, v1));
        }
        d = scale_of(_mm512_reduce_max_ps(amax), &id);
    }
    for (int64_t b = 0; b < nb; b++) {
        load32(x, b, bf16, &v0, &v1);
        if (!whole) d = scale_of(_mm512_reduce_max_ps(abs_max(v0, v1)), &id);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));   /* nearest even */
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(q + b * QK), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm512_cvtsepi32_epi8(q1));
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        if (whole) {
            total += sum;
        } else {
            dx[b] = d;
            c[b] = off * sum;
            s[b] = d * (float)sum;
        }
    }
    if (whole) {
        dx[0] = d;
        c[0] = off * total;
        s[0] = d * (float)total;
    }
}

INLINE __m512i bcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* rows (<= ROWS) quantized rows against one unit (wq: its quants, ws: its scales); left: the layer's outputs
 * from the unit's first one on */
INLINE void q_chunk(const int qt, const int8_t *xq, const float *xd, const int32_t *xc, const float *xs, int64_t k,
                    int64_t nb, const uint8_t *wq, const uint8_t *ws, int rows, const float *bias, void *out,
                    int64_t n, int64_t left, const int bf16, const int R)
{
    const int64_t uq = unit_quant_bytes(qt), us = unit_scale_bytes(qt), tq = uq / 2;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 acc[ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    if (qt == I8) {       /* one integer sum over all of k, scaled once: row scale x output channel's scale */
        __m512i dot[ROWS][2];
        for (int r = 0; r < R; r++) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
        for (int64_t b = 0; b < nb; b++)
            #pragma GCC unroll 8
            for (int g = 0; g < 8; g++)
                #pragma GCC unroll 2
                for (int t = 0; t < 2; t++) {
                    const __m512i v = _mm512_loadu_si512(wq + b * uq + t * tq + g * 64);
                    #pragma GCC unroll 4
                    for (int r = 0; r < R; r++)
                        if (r < rows)
                            dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], v, bcast4(xq + r * k + b * QK + 4 * g));
                }
        for (int t = 0; t < 2; t++) {
            const __m512 sw = _mm512_loadu_ps((const float *)ws + 16 * t);
            for (int r = 0; r < rows; r++) {
                const __m512i c = _mm512_sub_epi32(dot[r][t], _mm512_set1_epi32(xc[r * nb]));
                acc[r][t] = _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_mul_ps(sw, _mm512_set1_ps(xd[r * nb])));
            }
        }
        nb = 0;          /* no per-block pass */
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = wq + b * uq;
        const uint16_t *s = (const uint16_t *)(ws + b * us);
        __m512i dot[ROWS][2];
        for (int r = 0; r < R; r++) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
        if (qt == Q8_0) {
            #pragma GCC unroll 8
            for (int g = 0; g < 8; g++)
                #pragma GCC unroll 2
                for (int t = 0; t < 2; t++) {
                    const __m512i v = _mm512_loadu_si512(w + t * tq + g * 64);
                    #pragma GCC unroll 4
                    for (int r = 0; r < R; r++)
                        if (r < rows)
                            dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], v, bcast4(xq + r * k + b * QK + 4 * g));
                }
        } else {
            #pragma GCC unroll 4
            for (int g = 0; g < 4; g++)
                #pragma GCC unroll 2
                for (int t = 0; t < 2; t++) {
                    const __m512i v = _mm512_loadu_si512(w + t * tq + g * 64);
                    const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                    #pragma GCC unroll 4
                    for (int r = 0; r < R; r++)
                        if (r < rows) {
                            const int8_t *xr = xq + r * k + b * QK + 4 * g;
                            dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], lo, bcast4(xr));
                            dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], hi, bcast4(xr + 16));
                        }
                }
        }
        #pragma GCC unroll 2
        for (int t = 0; t < 2; t++) {
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 16 * t)));
            const __m512 mw = qt == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 32 + 16 * t)))
                                         : _mm512_setzero_ps();
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                if (r < rows) {
                    __m512i c = dot[r][t];
                    if (qt != Q4_1) c = _mm512_sub_epi32(c, _mm512_set1_epi32(xc[r * nb + b]));
                    const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * nb + b]));
                    acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), scale, acc[r][t]);
                    if (qt == Q4_1) acc[r][t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r * nb + b]), acc[r][t]);
                }
        }
    }
    for (int t = 0; t < 2 && left > 16 * t; t++) {
        const int64_t l = left - 16 * t;
        const __mmask16 mask = l >= 16 ? 0xffff : (__mmask16)((1u << l) - 1);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * t) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 v = _mm512_add_ps(acc[r][t], bv);
            if (bf16) _mm256_mask_storeu_epi16((uint16_t *)out + r * n + 16 * t, mask, to_bf16(v));
            else _mm512_mask_storeu_ps((float *)out + r * n + 16 * t, mask, v);
        }
    }
}

#define CHUNK_R(QT, BF16, R) q_chunk(QT, xq + r * k, xd + r * nb, xc + r * nb, xs + r * nb, k, nb, wq, ws, rows, \
                                     bias_u, (char *)out + (r * n + col) * (BF16 ? 2 : 4), n, n - col, BF16, R)
/* one row (decode) gets a copy of its own, with no registers kept for the other rows */
#define CHUNK(QT, BF16) do { if (rows == 1) CHUNK_R(QT, BF16, 1); else CHUNK_R(QT, BF16, ROWS); } while (0)

/* x [m, k] and out [m, n] contiguous, fp32 (bf16 != 0: bf16); packed from pack_q_weight; bias [n] fp32 or NULL.
 * Returns 0, or -1 when the activations' scratch cannot be allocated. */
int linear_q(const void *x, const uint8_t *packed, const float *bias, void *out, int64_t m, int64_t n, int64_t k,
             int qtype, int bf16)
{
    const int64_t nb = k / QK, units = (n + UNIT - 1) / UNIT, uq = unit_quant_bytes(qtype);
    const int64_t us = unit_scale_bytes(qtype), groups = (m + GROUP_ROWS - 1) / GROUP_ROWS;
    const int off = qtype == Q8_0 || qtype == I8 ? 128 : qtype == Q4_0 ? 8 : 0, whole = qtype == I8;
    const int64_t q_bytes = (m * k + 63) / 64 * 64;
    char *scratch = aligned_alloc(64, q_bytes + (m * nb * 12 + 63) / 64 * 64);
    if (!scratch) return -1;
    int8_t *xq = (int8_t *)scratch;
    float *xd = (float *)(scratch + q_bytes), *xs = xd + m * nb;
    int32_t *xc = (int32_t *)(xs + m * nb);
    #pragma omp parallel for schedule(static) if (m * k >= (1 << 16))
    for (int64_t r = 0; r < m; r++) {
        int8_t *q = xq + r * k;
        float *d = xd + r * nb, *s = xs + r * nb;
        int32_t *c = xc + r * nb;
        if (bf16) quantize_row((const uint16_t *)x + r * k, 1, nb, off, q, d, c, s, whole);
        else quantize_row((const float *)x + r * k, 0, nb, off, q, d, c, s, whole);
    }
    const uint8_t *scales = packed + units * nb * uq;
    #pragma omp parallel for collapse(2) schedule(static) if (m * n * k >= PARALLEL_MIN_MACS)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t u = 0; u < units; u++) {
            const int64_t col = u * UNIT, end = (g + 1) * GROUP_ROWS < m ? (g + 1) * GROUP_ROWS : m;
            const uint8_t *wq = packed + u * nb * uq, *ws = whole ? scales + u * 4 * UNIT : scales + u * nb * us;
            const float *bias_u = bias ? bias + col : NULL;
            for (int64_t r = g * GROUP_ROWS; r < end; r += ROWS) {
                const int rows = end - r < ROWS ? (int)(end - r) : ROWS;
                if (qtype == Q8_0) { if (bf16) CHUNK(Q8_0, 1); else CHUNK(Q8_0, 0); }
                else if (qtype == Q4_0) { if (bf16) CHUNK(Q4_0, 1); else CHUNK(Q4_0, 0); }
                else if (qtype == I8) { if (bf16) CHUNK(I8, 1); else CHUNK(I8, 0); }
                else { if (bf16) CHUNK(Q4_1, 1); else CHUNK(Q4_1, 0); }
            }
        }
    free(scratch);
    return 0;
}

#else   /* no AVX-512 VNNI: the callers check linear_q_available() first and dequantize instead */

int linear_q_available(void) { return 0; }
int linear_q(const void *x, const uint8_t *packed, const float *bias, void *out, int64_t m, int64_t n, int64_t k,
             int qtype, int bf16)
{ (void)x; (void)packed; (void)bias; (void)out; (void)m; (void)n; (void)k; (void)qtype; (void)bf16; return -1; }

#endif
