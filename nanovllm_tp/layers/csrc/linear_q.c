/* Linear layers over block-quantized weights on CPU: out = x @ w.T (+ bias) where w stays in blocks of 32 inputs:
 * GGUF's Q8_0 (d * q, q int8), Q4_0 (d * (q - 8), q 4 bits), Q4_1 (d * q + m), Q5_0 (d * (q - 16), q 5 bits),
 * Q5_1 (d * q + m), with d and m fp16 per block; the K-quants unpacked by layers/quant_kblocks.py into blocks of
 * 32: Q4_K and Q5_K ((d * sc) * q - dmin * mn, q 4 or 5 bits), Q6_K ((d * sc_half) * (q - 32), one 8-bit sc per
 * 16 inputs), with fp16 d (and dmin) per super-block of 256 inputs and 6- or 8-bit integers sc (and mn) per block.
 *
 * The weight is repacked once (pack_q_weight) into units of 32 outputs, two tiles of 16 lanes, so that one
 * 64-byte load holds 4 consecutive k of 16 outputs, the operand layout of VPDPBUSD (u8 x s8, 4 products summed
 * per int32 lane):
 *     quants  [unit][block][tile][group][16 lanes][4 bytes]     Q8_0 (as q + 128), I8: one byte per quant, 8
 *                                                               groups; the others 4 groups of 4-bit pairs (low
 *                                                               nibble k = 4g + i, high 16 + 4g + i), then
 *             [unit][block][tile][plane][16 lanes][4 bytes]     the bits above the nibble: 5-bit types one plane
 *                                                               (byte i: bit g of k = 4g + i, bit 4 + g of
 *                                                               16 + 4g + i), Q6_K two (bits 2g, 2g + 1 of
 *                                                               k = 4g + i, then of 16 + 4g + i)
 *     scales  [unit][block][d x 32][m x 32]                     after every quant; fp16
 *             K-quants: [unit][super-block of 8 blocks][fp16 d x 32][fp16 dmin x 32 (not Q6_K)]
 *                                                     [block][u8 sc x 32][u8 mn x 32, or Q6_K: int8 sc x 32 per half]
 * Bits per weight: Q4_0 4.5, Q4_1 5, Q5_0 5.5, Q5_1 6, Q8_0 8.5, Q4_K 4.625, Q5_K 5.625, Q6_K 6.5625 (the file's
 * but for the K-quants' scales, a byte each instead of 6 bits: 0.125 more). The kernel forms d * sc and dmin * mn
 * in fp32, exact products of an fp16 and an integer of up to 8 bits, one multiply per block and 16 lanes, and
 * puts a quant's high bits back above its nibble with a GFNI affine transform (without GFNI a shift and a mask)
 * and a vpternlogd select per 64 bytes. The last unit is zero-padded. A thread's units are one contiguous stream,
 * read once per row group.
 *
 * Activations are quantized per row and per block of 32 (as llama.cpp's Q8_0/Q8_1 activation blocks): scale
 * dx = amax * (1/127) in fp32, q = round-half-even(x * (1/dx)), kept beside their sum. Each (output, block) then
 * costs an exact integer dot product of the stored unsigned values u against q, and
 *     y += (dw * dx) * (dot - off * sum(q))        off = 128 (Q8_0, u = q + 128), 8 (Q4_0), 16 (Q5_0), 0 (mins)
 *     y += mw * (dx * sum(q))                       the types with a min
 * (Q6_K: each half of 16 its own dot, sum and d, off = 32) in fp32: the same numbers as dequantizing both operands
 * (layers/quant.py's torch reference does that), summed in another order. I8 (int8 per output channel,
 * layers/quant.py's quantization="int8") stores q + 128 like Q8_0 and one fp32 scale per output; its activations
 * take one scale per span of I8_SPAN blocks (128 inputs; the last span what is left of k), and each output sums
 * one integer dot product per span, scaled by the span's dx, times its own scale at the end:
 * y = sw * sum over spans of dx * (dot - 128 * sum(q)). (On SmolLM2 one scale per row cost 3.96% of perplexity,
 * spans of 128 1.03% with a quarter of the int32 -> fp32 steps of blocks of 32, which cost 0.44%.) One kernel
 * serves decode (bound by reading the weights: every 64 bytes of the stream prefetched PREFETCH bytes ahead into
 * L2, which took one row on an AMD EPYC from 9 to 13-16 GB/s; 8 KiB ahead read 1B-shaped weights at 2 threads
 * 5-10% faster than 4 KiB, and leaving Q6_K's second plane to the hardware prefetcher cost it 40%) and prefill
 * (chunks of ROWS rows reuse a unit's weights from cache). Without AVX-512 VNNI at compile time
 * linear_q_available() says 0 and the weights are dequantized at load instead.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layer_kernels.h"

#define QK 32
#ifndef I8_SPAN
#define I8_SPAN 4         /* I8's activations: one scale per span of 4 blocks of 32 (128 inputs) */
#endif
#define UNIT 32
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,     /* ggml type ids */
       I8 = 100 };                        /* int8 per output channel: rows of [fp32 scale][k int8] (layers/quant.py) */

/* What a type's packed blocks hold. Quants: one byte each (8 groups of 4 per tile), or 4-bit pairs (Q4_0, Q4_1,
 * Q4_K: 4 groups). Scales per output and block of 32: d, then a min m (w = d * (u - off) + m) or, for Q6_K, the
 * second half's d (its sub-blocks are 16 wide: w = d_half * (u - 32)); fp16 as the file stores them, for the
 * K-quants formed from the super-block's fp16 and the block's integers (m = -(dmin * mn)). off: subtracted from the
 * stored u. */
static int byte_quants(int qt) { return qt == Q8_0 || qt == I8; }
/* bits of each quant above its nibble: the 5-bit types one, Q6_K two (kept in planes after the nibble pairs) */
static int high_bits(int qt) { return qt == Q6_K ? 2 : qt == Q5_0 || qt == Q5_1 || qt == Q5_K; }
static int has_min(int qt) { return qt == Q4_1 || qt == Q5_1 || qt == Q4_K || qt == Q5_K; }
static int halves(int qt) { return qt == Q6_K; }
static int kquant(int qt) { return qt == Q4_K || qt == Q5_K || qt == Q6_K; }
static int offset_of(int qt)
{
    return qt == Q8_0 || qt == I8 ? 128 : qt == Q4_0 ? 8 : qt == Q5_0 ? 16 : qt == Q6_K ? 32 : 0;
}
static int scale_count(int qt) { return qt == I8 ? 0 : 1 + (has_min(qt) || halves(qt)); }
static int64_t unit_quant_bytes(int qt) { return byte_quants(qt) ? 1024 : 512 + 128 * high_bits(qt); }
/* a K-quant super-block's scales per unit: its fp16 d (and dmin) x 32, then its 8 blocks' integers x 2 x 32 */
static int64_t super_head_bytes(int qt) { return (1 + has_min(qt)) * 2 * UNIT; }
static int64_t super_bytes(int qt) { return super_head_bytes(qt) + 8 * 2 * UNIT; }
/* a unit's scales over nb blocks (I8: its 32 fp32 row scales), and block b's (a K-quant's integers) among them */
static int64_t unit_scale_bytes(int qt, int64_t nb)
{
    return qt == I8 ? 4 * UNIT : kquant(qt) ? nb / 8 * super_bytes(qt) : nb * scale_count(qt) * 2 * UNIT;
}
static int64_t block_scales_at(int qt, int64_t b)
{
    return kquant(qt) ? b / 8 * super_bytes(qt) + super_head_bytes(qt) + b % 8 * 2 * UNIT
                      : b * scale_count(qt) * 2 * UNIT;
}
/* the raw blocks pack_q_weight reads: the file's (Q8_0, Q4_0, Q4_1), or layers/quant_kblocks.py's per block of
 * 32 ([fp16 d][fp16 m][32 u8] for Q5_0 / Q5_1, [fp16 d][fp16 dmin][sc][mn or sc2][32 u8] for the K-quants) */
static int64_t raw_head_bytes(int qt) { return qt == Q8_0 || qt == Q4_0 ? 2 : kquant(qt) ? 6 : 4; }
static int64_t raw_block_bytes(int qt) { return raw_head_bytes(qt) + (qt == Q4_0 || qt == Q4_1 ? 16 : 32); }
static int known(int qt)
{
    return qt == Q8_0 || qt == Q4_0 || qt == Q4_1 || qt == Q5_0 || qt == Q5_1 || qt == Q4_K || qt == Q5_K ||
           qt == Q6_K || qt == I8;
}

/* bytes of the packed form of an [n, k] weight, or -1 for a type this file does not know or k not whole blocks
 * (super-blocks of 256 for the K-quants); I8 keeps its 32 row scales (fp32) per unit after the quants */
int64_t q_packed_bytes(int64_t n, int64_t k, int qtype)
{
    if (!known(qtype) || k % (kquant(qtype) ? 8 * QK : QK)) return -1;
    const int64_t units = (n + UNIT - 1) / UNIT;
    return units * ((k / QK) * unit_quant_bytes(qtype) + unit_scale_bytes(qtype, k / QK));
}

/* raw: rows of raw blocks [n][k / 32] (I8: rows of [fp32 scale][k int8]); packed: q_packed_bytes bytes */
void pack_q_weight(const uint8_t *raw, uint8_t *packed, int64_t n, int64_t k, int qtype)
{
    const int64_t nb = k / QK, units = (n + UNIT - 1) / UNIT, uq = unit_quant_bytes(qtype);
    const int64_t us = unit_scale_bytes(qtype, nb), bb = raw_block_bytes(qtype), head = raw_head_bytes(qtype);
    const int64_t groups = byte_quants(qtype) ? 8 : 4, scales_n = scale_count(qtype);
    const int offset = qtype == Q8_0 || qtype == I8 ? 0x80 : 0;    /* int8 quants are stored as u8 = q + 128 */
    const int hb = high_bits(qtype);
    /* one byte per quant in the raw block, packed into 4-bit pairs (and high planes) here; Q4_0 and Q4_1 raw
     * blocks are the file's, already in pairs */
    const int expand4 = !byte_quants(qtype) && qtype != Q4_0 && qtype != Q4_1;
    uint8_t *scales = packed + units * nb * uq;
    #pragma omp parallel for schedule(static) if (n * k >= (1 << 20))
    for (int64_t u = 0; u < units; u++)
        for (int64_t b = 0; b < nb; b++)
            for (int lane = 0; lane < UNIT; lane++) {
                const int64_t row = u * UNIT + lane;
                uint8_t *q = packed + (u * nb + b) * uq + (lane / 16) * (uq / 2) + (lane % 16) * 4;
                const uint8_t *qs = NULL;
                if (qtype == I8) {
                    float *row_scales = (float *)(scales + u * us);
                    row_scales[lane] = 0.f;
                    if (row < n) {
                        memcpy(row_scales + lane, raw + row * (4 + k), 4);
                        qs = raw + row * (4 + k) + 4 + b * QK;
                    }
                } else {
                    const uint8_t *src = row < n ? raw + (row * nb + b) * bb : NULL;
                    uint8_t *s = scales + u * us + block_scales_at(qtype, b);
                    qs = src ? src + head : NULL;
                    if (kquant(qtype)) {      /* the super-block's fp16 with its first block, then the integers */
                        uint8_t *sup = scales + u * us + b / 8 * super_bytes(qtype);
                        for (int64_t j = 0; j < 1 + has_min(qtype) && b % 8 == 0; j++) {
                            memset(sup + (j * UNIT + lane) * 2, 0, 2);
                            if (src) memcpy(sup + (j * UNIT + lane) * 2, src + j * 2, 2);
                        }
                        for (int64_t j = 0; j < 2; j++) s[j * UNIT + lane] = src ? src[4 + j] : 0;
                    } else {
                        for (int64_t j = 0; j < scales_n; j++) {
                            memset(s + (j * UNIT + lane) * 2, 0, 2);
                            if (src) memcpy(s + (j * UNIT + lane) * 2, src + j * 2, 2);
                        }
                    }
                }
                for (int g = 0; g < groups; g++)
                    for (int i = 0; i < 4; i++)
                        q[g * 64 + i] = !qs ? 0
                                        : expand4 ? (uint8_t)((qs[4 * g + i] & 0xf) | (qs[16 + 4 * g + i] & 0xf) << 4)
                                        : (uint8_t)(qs[4 * g + i] ^ offset);
                for (int i = 0; i < 4 && hb; i++) {     /* the high planes: byte i of a lane's 4 in each */
                    uint8_t first = 0, second = 0;
                    for (int g = 0; g < 4 && qs; g++) {
                        const int a = qs[4 * g + i] >> 4, c = qs[16 + 4 * g + i] >> 4;
                        if (hb == 1) first |= (uint8_t)((a & 1) << g | (c & 1) << (4 + g));
                        else first |= (uint8_t)((a & 3) << 2 * g), second |= (uint8_t)((c & 3) << 2 * g);
                    }
                    q[256 + i] = first;
                    if (hb == 2) q[320 + i] = second;
                }
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

static float half_at(const uint8_t *s, int j, int lane)
{
    uint16_t h;
    memcpy(&h, s + (j * UNIT + lane) * 2, 2);
    return half_to_float(h);
}

/* output lane's scale j (0: d; 1: the min, or Q6_K's second d) of block b, us: the unit's scales */
static float scale_at(const uint8_t *us, int64_t b, int j, int lane, int qt)
{
    if (!kquant(qt)) return half_at(us + block_scales_at(qt, b), j, lane);
    const uint8_t *sup = us + b / 8 * super_bytes(qt), *s = us + block_scales_at(qt, b);
    const int i = s[j * UNIT + lane];
    if (halves(qt)) return half_at(sup, 0, lane) * (float)(int8_t)i;
    return j ? -(half_at(sup, 1, lane) * (float)i) : half_at(sup, 0, lane) * (float)i;
}

/* Rows ids[0..count) of a packed weight of a GGUF type (not I8), dequantized (d * (u - off) + m in fp32, then
 * the output dtype): the embedding's lookup when the LM head shares its weight. */
void gather_q_rows(const uint8_t *packed, const int64_t *ids, void *out, int64_t count, int64_t n, int64_t k,
                   int qtype, int bf16)
{
    const int64_t nb = k / QK, units = (n + UNIT - 1) / UNIT, uq = unit_quant_bytes(qtype);
    const int64_t us = unit_scale_bytes(qtype, nb);
    const int off = offset_of(qtype), bytes = byte_quants(qtype), hb = high_bits(qtype);
    const uint8_t *scales = packed + units * nb * uq;
    #pragma omp parallel for schedule(static) if (count * k >= (1 << 16))
    for (int64_t e = 0; e < count; e++) {
        const int64_t row = ids[e], u = row / UNIT, lane = row % UNIT;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *q = packed + (u * nb + b) * uq + (lane / 16) * (uq / 2) + (lane % 16) * 4;
            const uint8_t *s = scales + u * us;
            const float d = scale_at(s, b, 0, lane, qtype);
            const float d2 = scale_count(qtype) > 1 ? scale_at(s, b, 1, lane, qtype) : 0.f;
            for (int j = 0; j < QK; j++) {
                const int jj = j % 16, second = j >= 16, g = jj / 4, i = jj % 4;
                int v = bytes ? q[j / 4 * 64 + j % 4] : (q[g * 64 + i] >> (second ? 4 : 0)) & 0xf;
                if (hb == 1) v |= (q[256 + i] >> (g + 4 * second) & 1) << 4;
                else if (hb == 2) v |= (q[256 + 64 * second + i] >> 2 * g & 3) << 4;
                const float w = halves(qtype) ? (float)(v - off) * (j < 16 ? d : d2)
                                : has_min(qtype) ? (float)v * d + d2 : (float)(v - off) * d;
                store_float(out, e * k + b * QK + j, w, bf16);
            }
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "simd.h"

#define ROWS 4            /* rows per chunk: 2 x ROWS int and float accumulators stay in registers */
#define GROUP_ROWS 32     /* rows per work unit: the unit's weights stay in L1/L2 across its chunks */
#define PARALLEL_MIN_MACS (1 << 18)
#define PREFETCH 8192     /* bytes ahead in the weight stream (into L2) */
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

/* One row of k activations (fp32, or bf16) into int8 q, one scale per span of `span` blocks of 32 (the last span
 * what is left): dx, off * sum(q), dx * sum(q) per span (span 1: per block; with hi (Q6_K's two halves of 16):
 * c = off * sum of the first half, hi = off * sum of the second). */
INLINE void quantize_row(const void *x, const int bf16, int64_t nb, int off, int8_t *q, float *dx, int32_t *c,
                         float *s, int32_t *hi, const int span)
{
    __m512 v0, v1;
    float id = 0.f;
    for (int64_t a = 0, b0 = 0; b0 < nb; a++, b0 += span) {
        const int64_t b1 = b0 + span < nb ? b0 + span : nb;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t b = b0; b < b1; b++) {
            load32(x, b, bf16, &v0, &v1);
            amax = _mm512_max_ps(amax, abs_max(v0, v1));
        }
        const float d = scale_of(_mm512_reduce_max_ps(amax), &id);
        __m512i sum = _mm512_setzero_si512(), low = _mm512_setzero_si512();
        for (int64_t b = b0; b < b1; b++) {
            if (span > 1) load32(x, b, bf16, &v0, &v1);      /* span 1: still in registers */
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));   /* nearest even */
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)(q + b * QK), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm512_cvtsepi32_epi8(q1));
            low = _mm512_add_epi32(low, q0);
            sum = _mm512_add_epi32(sum, _mm512_add_epi32(q0, q1));
        }
        const int32_t total = _mm512_reduce_add_epi32(sum);
        dx[a] = d;
        s[a] = d * (float)total;
        if (hi) {
            const int32_t first = _mm512_reduce_add_epi32(low);
            c[a] = off * first;
            hi[a] = off * (total - first);
        } else {
            c[a] = off * total;
        }
    }
}

/* 16 lanes (tile t) of fp16 scales j (a block's 0: d; 1: the min, or Q6_K's second d; a super-block's d, dmin) */
INLINE __m512 scales16(const uint8_t *s, int j, int t)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s + 32 * j + 16 * t)));
}

/* 16 lanes (tile t) of a K-quant block's integers j (unsigned 6-bit sc, mn; Q6_K's signed sc) times fp16 sup */
INLINE __m512 times16(__m512 sup, const uint8_t *s, int j, int t, const int is_signed)
{
    const __m128i i = _mm_loadu_si128((const __m128i *)(s + 32 * j + 16 * t));
    return _mm512_mul_ps(sup, _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(i) : _mm512_cvtepu8_epi32(i)));
}

/* the weight stream PREFETCH bytes ahead of p, by a unit's first chunk of rows (the others find it in cache) */
INLINE void ahead(const uint8_t *p, int first) { if (first) _mm_prefetch((const char *)p + PREFETCH, _MM_HINT_T1); }

/* bits from .. from + count - 1 of each byte of a high plane moved to bits 4 .. 3 + count, every other bit 0:
 * with GFNI one affine transform per 64 bytes (dst bit i = parity(src & matrix byte 7 - i)), else a 16-bit shift
 * (bits crossing into the next byte are masked off) and a mask */
INLINE __m512i above4(__m512i h, const int from, const int count)
{
#ifdef __GFNI__
    const uint64_t matrix = (uint64_t)(1u << from) << 24 | (count == 2 ? (uint64_t)(2u << from) << 16 : 0);
    return _mm512_gf2p8affine_epi64_epi8(h, _mm512_set1_epi64((long long)matrix), 0);
#else
    const int s = 4 - from;
    const __m512i moved = s > 0 ? _mm512_slli_epi16(h, (unsigned)s) : s < 0 ? _mm512_srli_epi16(h, (unsigned)-s) : h;
    return _mm512_and_si512(moved, _mm512_set1_epi8(count == 2 ? 0x30 : 0x10));
#endif
}

INLINE __m512i bcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* rows (<= ROWS) quantized rows against one unit (wq: its quants, ws: its scales); first: the unit's first chunk
 * (it prefetches); left: the layer's outputs from the unit's first one on */
INLINE void q_chunk(const int qt, const int8_t *xq, const float *xd, const int32_t *xc, const float *xs,
                    const int32_t *xh, int64_t k,
                    int64_t nb, const uint8_t *wq, const uint8_t *ws, int rows, int first, const float *bias,
                    void *out, int64_t n, int64_t left, const int bf16, const int R)
{
    const int64_t uq = unit_quant_bytes(qt), tq = uq / 2;
    const int hb = high_bits(qt);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 acc[ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    if (qt == I8) {       /* per span: its integer sums x its activation scale; at the end x each output's scale */
        for (int64_t a = 0, b0 = 0; b0 < nb; a++, b0 += I8_SPAN) {
            const int64_t b1 = b0 + I8_SPAN < nb ? b0 + I8_SPAN : nb;
            __m512i dot[ROWS][2];          /* from -128 * sum(q): the stored u = q + 128 summed exactly */
            for (int r = 0; r < R; r++) dot[r][0] = dot[r][1] = _mm512_set1_epi32(r < rows ? -xc[r * nb + a] : 0);
            for (int64_t b = b0; b < b1; b++)
                #pragma GCC unroll 8
                for (int g = 0; g < 8; g++)
                    #pragma GCC unroll 2
                    for (int t = 0; t < 2; t++) {
                        ahead(wq + b * uq + t * tq + g * 64, first);
                        const __m512i v = _mm512_loadu_si512(wq + b * uq + t * tq + g * 64);
                        #pragma GCC unroll 4
                        for (int r = 0; r < R; r++)
                            if (r < rows)
                                dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], v, bcast4(xq + r * k + b * QK + 4 * g));
                    }
            #pragma GCC unroll 2
            for (int t = 0; t < 2; t++)
                #pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    if (r < rows)
                        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][t]), _mm512_set1_ps(xd[r * nb + a]),
                                                    acc[r][t]);
        }
        #pragma GCC unroll 2
        for (int t = 0; t < 2; t++) {
            const __m512 sw = _mm512_loadu_ps((const float *)ws + 16 * t);
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                if (r < rows) acc[r][t] = _mm512_mul_ps(acc[r][t], sw);
        }
        nb = 0;          /* no per-block pass */
    }
    const int bytes = byte_quants(qt), half = halves(qt), min = has_min(qt), kq = kquant(qt);
    /* a K-quant super-block's d and dmin per tile, for its 8 blocks */
    __m512 dsup[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, msup[2] = {dsup[0], dsup[1]};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = wq + b * uq;
        const uint8_t *s = ws + block_scales_at(qt, b), *sup = ws + b / 8 * super_bytes(qt);
        #pragma GCC unroll 2
        for (int t = 0; t < 2 && kq && b % 8 == 0; t++) {
            dsup[t] = scales16(sup, 0, t);
            msup[t] = min ? scales16(sup, 1, t) : dsup[t];
        }
        __m512i dot[ROWS][2], dot2[ROWS][2];      /* dot2: Q6_K's second half of the block */
        for (int r = 0; r < R; r++) dot[r][0] = dot[r][1] = dot2[r][0] = dot2[r][1] = _mm512_setzero_si512();
        if (bytes) {
            #pragma GCC unroll 8
            for (int g = 0; g < 8; g++)
                #pragma GCC unroll 2
                for (int t = 0; t < 2; t++) {
                    ahead(w + t * tq + g * 64, first);
                    const __m512i v = _mm512_loadu_si512(w + t * tq + g * 64);
                    #pragma GCC unroll 4
                    for (int r = 0; r < R; r++)
                        if (r < rows) dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], v, bcast4(xq + r * k + b * QK + 4 * g));
                }
        } else {
            __m512i h0[2], h1[2];      /* the high planes of each tile (5-bit types: one; Q6_K: two) */
            #pragma GCC unroll 2
            for (int t = 0; t < 2; t++)
                if (hb) {      /* every 64 bytes of the stream prefetched: the planes too */
                    ahead(w + t * tq + 256, first);
                    h0[t] = _mm512_loadu_si512(w + t * tq + 256);
                    h1[t] = h0[t];
                    if (hb == 2) {
                        ahead(w + t * tq + 320, first);
                        h1[t] = _mm512_loadu_si512(w + t * tq + 320);
                    }
                }
            #pragma GCC unroll 4
            for (int g = 0; g < 4; g++)
                #pragma GCC unroll 2
                for (int t = 0; t < 2; t++) {
                    ahead(w + t * tq + g * 64, first);
                    const __m512i v = _mm512_loadu_si512(w + t * tq + g * 64);
                    __m512i lo, hi;
                    if (hb) {     /* the nibble's bits 0-3 beside the high bits at 4 (and 5): vpternlogd's select */
                        lo = _mm512_ternarylogic_epi32(v, above4(h0[t], hb == 1 ? g : 2 * g, hb), low4, 0xE4);
                        hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4),
                                                       above4(h1[t], hb == 1 ? 4 + g : 2 * g, hb), low4, 0xE4);
                    } else {
                        lo = _mm512_and_si512(v, low4);
                        hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                    }
                    #pragma GCC unroll 4
                    for (int r = 0; r < R; r++)
                        if (r < rows) {
                            const int8_t *xr = xq + r * k + b * QK + 4 * g;
                            dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], lo, bcast4(xr));
                            if (half) dot2[r][t] = _mm512_dpbusd_epi32(dot2[r][t], hi, bcast4(xr + 16));
                            else dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], hi, bcast4(xr + 16));
                        }
                }
        }
        #pragma GCC unroll 2
        for (int t = 0; t < 2; t++) {      /* d, and the second scale: the min (K-quants: -min), or Q6_K's second d */
            __m512 dw, d2 = _mm512_setzero_ps();
            if (kq) {
                dw = times16(dsup[t], s, 0, t, half);
                d2 = times16(msup[t], s, 1, t, half);
            } else {
                dw = scales16(s, 0, t);
                if (min || half) d2 = scales16(s, 1, t);
            }
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                if (r < rows) {
                    __m512i c = dot[r][t];
                    const __m512 dx = _mm512_set1_ps(xd[r * nb + b]);
                    if (!min) c = _mm512_sub_epi32(c, _mm512_set1_epi32(xc[r * nb + b]));
                    acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_mul_ps(dw, dx), acc[r][t]);
                    if (min && kq) acc[r][t] = _mm512_fnmadd_ps(d2, _mm512_set1_ps(xs[r * nb + b]), acc[r][t]);
                    else if (min) acc[r][t] = _mm512_fmadd_ps(d2, _mm512_set1_ps(xs[r * nb + b]), acc[r][t]);
                    if (half) {
                        const __m512i c2 = _mm512_sub_epi32(dot2[r][t], _mm512_set1_epi32(xh[r * nb + b]));
                        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c2), _mm512_mul_ps(d2, dx), acc[r][t]);
                    }
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

#define CHUNK_R(QT, BF16, R) q_chunk(QT, xq + r * k, xd + r * nb, xc + r * nb, xs + r * nb, xh + r * nb, k, nb, wq, \
                                     ws, rows, r == g * GROUP_ROWS, \
                                     bias_u, (char *)out + (r * n + col) * (BF16 ? 2 : 4), n, n - col, BF16, R)
/* one row (decode) gets a copy of its own, with no registers kept for the other rows */
#define CHUNK(QT, BF16) do { if (rows == 1) CHUNK_R(QT, BF16, 1); else CHUNK_R(QT, BF16, ROWS); } while (0)

/* x [m, k] and out [m, n] contiguous, fp32 (bf16 != 0: bf16); packed from pack_q_weight; bias [n] fp32 or NULL.
 * Returns 0, or -1 when the activations' scratch cannot be allocated. */
int linear_q(const void *x, const uint8_t *packed, const float *bias, void *out, int64_t m, int64_t n, int64_t k,
             int qtype, int bf16)
{
    const int64_t nb = k / QK, units = (n + UNIT - 1) / UNIT, uq = unit_quant_bytes(qtype);
    const int64_t us = unit_scale_bytes(qtype, nb), groups = (m + GROUP_ROWS - 1) / GROUP_ROWS;
    const int off = offset_of(qtype);
    const int64_t q_bytes = (m * k + 63) / 64 * 64;
    char *scratch = aligned_alloc(64, q_bytes + (m * nb * 16 + 63) / 64 * 64);
    if (!scratch) return -1;
    int8_t *xq = (int8_t *)scratch;
    float *xd = (float *)(scratch + q_bytes), *xs = xd + m * nb;
    int32_t *xc = (int32_t *)(xs + m * nb), *xh = xc + m * nb;
    #pragma omp parallel for schedule(static) if (m * k >= (1 << 16))
    for (int64_t r = 0; r < m; r++) {
        int8_t *q = xq + r * k;
        float *d = xd + r * nb, *s = xs + r * nb;
        int32_t *c = xc + r * nb, *h = halves(qtype) ? xh + r * nb : NULL;
        if (qtype == I8 && bf16) quantize_row((const uint16_t *)x + r * k, 1, nb, off, q, d, c, s, h, I8_SPAN);
        else if (qtype == I8) quantize_row((const float *)x + r * k, 0, nb, off, q, d, c, s, h, I8_SPAN);
        else if (bf16) quantize_row((const uint16_t *)x + r * k, 1, nb, off, q, d, c, s, h, 1);
        else quantize_row((const float *)x + r * k, 0, nb, off, q, d, c, s, h, 1);
    }
    const uint8_t *scales = packed + units * nb * uq;
    #pragma omp parallel for collapse(2) schedule(static) if (m * n * k >= PARALLEL_MIN_MACS)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t u = 0; u < units; u++) {
            const int64_t col = u * UNIT, end = (g + 1) * GROUP_ROWS < m ? (g + 1) * GROUP_ROWS : m;
            const uint8_t *wq = packed + u * nb * uq, *ws = scales + u * us;
            const float *bias_u = bias ? bias + col : NULL;
            for (int64_t r = g * GROUP_ROWS; r < end; r += ROWS) {
                const int rows = end - r < ROWS ? (int)(end - r) : ROWS;
                switch (qtype) {     /* one copy of the chunk per type and dtype, its branches decided */
                case Q8_0: if (bf16) CHUNK(Q8_0, 1); else CHUNK(Q8_0, 0); break;
                case Q4_0: if (bf16) CHUNK(Q4_0, 1); else CHUNK(Q4_0, 0); break;
                case Q4_1: if (bf16) CHUNK(Q4_1, 1); else CHUNK(Q4_1, 0); break;
                case Q5_0: if (bf16) CHUNK(Q5_0, 1); else CHUNK(Q5_0, 0); break;
                case Q5_1: if (bf16) CHUNK(Q5_1, 1); else CHUNK(Q5_1, 0); break;
                case Q4_K: if (bf16) CHUNK(Q4_K, 1); else CHUNK(Q4_K, 0); break;
                case Q5_K: if (bf16) CHUNK(Q5_K, 1); else CHUNK(Q5_K, 0); break;
                case Q6_K: if (bf16) CHUNK(Q6_K, 1); else CHUNK(Q6_K, 0); break;
                default: if (bf16) CHUNK(I8, 1); else CHUNK(I8, 0);
                }
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
