/* Linear layers on CPU: out = x @ w.T (+ bias) with fp32 accumulation; bf16 (AVX-512 BF16, rounded to bf16 once at
 * the end) and fp32 (AVX-512F, at the end of this file).
 *
 * The weight is packed once (pack_bf16_weight) so that one 64-byte load holds two consecutive k of 16 outputs,
 * the operand layout of VDPBF16PS:
 *     packed[block][k / 2][16 outputs][2 k]     block = 16 outputs, the last block zero-padded; k even
 * A step then reads the weight once, front to back, with no horizontal sums: each load is multiplied by one
 * broadcast pair of x per row and accumulated into 16 fp32 outputs. Work units are pairs of blocks (32 outputs)
 * against groups of rows; inside a unit, chunks of up to ROWS rows (the group's rows split evenly: 16 rows as
 * 8 + 8, not 6 + 6 + 4) reuse the unit's weight from L1, so one kernel serves decode (one to a few rows: bound by
 * reading the weights, prefetched ahead into L2) and prefill (many rows: bound by the multiply-adds). Each count of
 * rows is its own copy of the loop (chunk_rows): 1.15-1.25x at 8-48 rows against one loop testing each row.
 * Built into the same library as cpu_kernels.c; without AVX-512 BF16 (or F, for fp32) at compile time the
 * functions report that they are unavailable and the layers use oneDNN instead.
 */
#include <stdint.h>

#include "layer_kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "simd.h"

#define ROWS 8            /* most rows per chunk: 2 x ROWS accumulators, 2 weight registers and a broadcast */
#define GROUP_ROWS 48     /* rows per work unit: the unit's weight stays in L1/L2 across its chunks */
#define PREFETCH 32       /* k pairs ahead (2 KiB per block) */
#define PARALLEL_MIN_MACS (1 << 18)

int linear_bf16_available(void) { return 1; }

void pack_bf16_weight(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k)
{
    const int64_t pairs = k / 2, blocks = (n + 15) / 16;
    #pragma omp parallel for schedule(static) if (n * k >= PARALLEL_MIN_MACS)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t j = 0; j < 16; j++) {
                const int64_t row = b * 16 + j;
                uint16_t *dst = packed + ((b * pairs + p) * 16 + j) * 2;
                dst[0] = row < n ? w[row * k + 2 * p] : 0;
                dst[1] = row < n ? w[row * k + 2 * p + 1] : 0;
            }
}

static inline __m512 bias_of(const uint16_t *bias, __mmask16 mask)
{
    if (!bias) return _mm512_setzero_ps();
    return from_bf16(_mm256_maskz_loadu_epi16(mask, bias));
}

/* rows (<= ROWS) rows of x (k/2 int32 pairs apart) against blocks w0 and w1; w1's outputs are masked off when
 * the unit has one block only. Inlined for each count of rows (chunk_rows): a count known to the compiler leaves
 * the loop over pairs no test per row and no register spills, only loads and multiply-adds. */
static inline __attribute__((always_inline)) void chunk(const int32_t *x, int64_t pairs, const uint16_t *w0,
                                                        const uint16_t *w1, const int rows, int prefetch,
                                                        const uint16_t *bias, uint16_t *out, int64_t n, __mmask16 m0,
                                                        __mmask16 m1)
{
    __m512 acc[ROWS][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        if (prefetch) {
            _mm_prefetch((const char *)(w0 + (p + PREFETCH) * 32), _MM_HINT_T1);
            _mm_prefetch((const char *)(w1 + (p + PREFETCH) * 32), _MM_HINT_T1);
        }
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + p * 32);
        const __m512bh v1 = (__m512bh)_mm512_loadu_si512(w1 + p * 32);
        #pragma GCC unroll 16
        for (int r = 0; r < ROWS; r++) {
            if (r < rows) {
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(x[r * pairs + p]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, v0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, v1);
            }
        }
    }
    const __m512 b0 = bias_of(bias, m0), b1 = bias_of(bias ? bias + 16 : bias, m1);
    for (int r = 0; r < rows; r++) {
        _mm256_mask_storeu_epi16(out + r * n, m0, to_bf16(_mm512_add_ps(acc[r][0], b0)));
        _mm256_mask_storeu_epi16(out + r * n + 16, m1, to_bf16(_mm512_add_ps(acc[r][1], b1)));
    }
}

static void chunk_rows(const int32_t *x, int64_t pairs, const uint16_t *w0, const uint16_t *w1, int rows,
                       int prefetch, const uint16_t *bias, uint16_t *out, int64_t n, __mmask16 m0, __mmask16 m1)
{
#define CHUNK_OF(R) chunk(x, pairs, w0, w1, R, prefetch, bias, out, n, m0, m1)
    switch (rows) {     /* 1 to ROWS */
    case 8: CHUNK_OF(8); break;
    case 7: CHUNK_OF(7); break;
    case 6: CHUNK_OF(6); break;
    case 5: CHUNK_OF(5); break;
    case 4: CHUNK_OF(4); break;
    case 3: CHUNK_OF(3); break;
    case 2: CHUNK_OF(2); break;
    default: CHUNK_OF(1);
    }
#undef CHUNK_OF
}

/* x [m, k] and out [m, n] contiguous bf16, k even; packed from pack_bf16_weight; bias [n] bf16 or NULL */
void linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *out, int64_t m,
                 int64_t n, int64_t k)
{
    const int64_t pairs = k / 2, blocks = (n + 15) / 16, units = (blocks + 1) / 2;
    const int64_t groups = (m + GROUP_ROWS - 1) / GROUP_ROWS;
    #pragma omp parallel for collapse(2) schedule(static) if (m * n * k >= PARALLEL_MIN_MACS)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t u = 0; u < units; u++) {
            const int64_t col = u * 32, left = n - col;
            const uint16_t *w0 = packed + 2 * u * pairs * 32, *w1 = 2 * u + 1 < blocks ? w0 + pairs * 32 : w0;
            const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            const __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
            const int64_t start = g * GROUP_ROWS, end = (g + 1) * GROUP_ROWS < m ? (g + 1) * GROUP_ROWS : m;
            const int64_t chunks = (end - start + ROWS - 1) / ROWS;     /* the group's rows split evenly */
            for (int64_t j = 0; j < chunks; j++) {
                const int64_t r = start + j * (end - start) / chunks, r1 = start + (j + 1) * (end - start) / chunks;
                chunk_rows((const int32_t *)(x + r * k), pairs, w0, w1, (int)(r1 - r), !j, bias ? bias + col : bias,
                           out + r * n + col, n, m0, m1);
            }
        }
}

#else   /* no AVX-512 BF16: the callers check linear_bf16_available() first */

int linear_bf16_available(void) { return 0; }
void pack_bf16_weight(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k)
{ (void)w; (void)packed; (void)n; (void)k; }
void linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *out, int64_t m,
                 int64_t n, int64_t k) { (void)x; (void)packed; (void)bias; (void)out; (void)m; (void)n; (void)k; }

#endif

/* ---------------------------------------------------------------- fp32
 * The same scheme in fp32: packed[block][k][16 outputs], 64 outputs (four blocks) per unit against chunks of
 * F32_ROWS rows, 24 accumulators; a unit's weight is read from memory once per row group and from cache after.
 * The sum over k runs in order, one fused multiply-add per k.
 */
#if defined(__AVX512F__)
#include <immintrin.h>

#define F32_ROWS 6
#define F32_BLOCKS 4          /* blocks of 16 outputs per unit */
#define F32_GROUP_ROWS 48
#define F32_PREFETCH 16       /* k ahead (1 KiB per block) */
#define F32_PARALLEL_MIN_MACS (1 << 18)

int linear_f32_available(void) { return 1; }

void pack_f32_weight(const float *w, float *packed, int64_t n, int64_t k)
{
    const int64_t blocks = (n + 15) / 16;
    #pragma omp parallel for schedule(static) if (n * k >= F32_PARALLEL_MIN_MACS)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t c = 0; c < k; c++)
            for (int64_t j = 0; j < 16; j++) {
                const int64_t row = b * 16 + j;
                packed[(b * k + c) * 16 + j] = row < n ? w[row * k + c] : 0.f;
            }
}

/* rows (<= F32_ROWS) rows of x against the unit's nb blocks (the missing ones read block 0, not stored);
 * left: outputs of the layer from the unit's first one on */
static inline void f32_chunk(const float *x, int64_t k, const float *w, int nb, int rows, int prefetch,
                             const float *bias, float *out, int64_t n, int64_t left)
{
    __m512 acc[F32_ROWS][F32_BLOCKS];
    for (int r = 0; r < F32_ROWS; r++)
        for (int j = 0; j < F32_BLOCKS; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c++) {
        __m512 v[F32_BLOCKS];
        #pragma GCC unroll 4
        for (int j = 0; j < F32_BLOCKS; j++) {
            const float *block = w + (j < nb ? j : 0) * k * 16;
            if (prefetch) _mm_prefetch((const char *)(block + (c + F32_PREFETCH) * 16), _MM_HINT_T1);
            v[j] = _mm512_loadu_ps(block + c * 16);
        }
        #pragma GCC unroll 6
        for (int r = 0; r < F32_ROWS; r++) {
            if (r < rows) {
                const __m512 xb = _mm512_set1_ps(x[r * k + c]);
                #pragma GCC unroll 4
                for (int j = 0; j < F32_BLOCKS; j++) acc[r][j] = _mm512_fmadd_ps(xb, v[j], acc[r][j]);
            }
        }
    }
    for (int j = 0; j < nb; j++) {
        const int64_t l = left - 16 * j;
        const __mmask16 mask = l >= 16 ? 0xffff : (__mmask16)((1u << l) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(out + r * n + 16 * j, mask, _mm512_add_ps(acc[r][j], b));
    }
}

/* x [m, k] and out [m, n] contiguous fp32; packed from pack_f32_weight; bias [n] fp32 or NULL */
void linear_f32(const float *x, const float *packed, const float *bias, float *out, int64_t m, int64_t n, int64_t k)
{
    const int64_t blocks = (n + 15) / 16, units = (blocks + F32_BLOCKS - 1) / F32_BLOCKS;
    const int64_t groups = (m + F32_GROUP_ROWS - 1) / F32_GROUP_ROWS;
    #pragma omp parallel for collapse(2) schedule(static) if (m * n * k >= F32_PARALLEL_MIN_MACS)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t u = 0; u < units; u++) {
            const int64_t col = u * 16 * F32_BLOCKS;
            const int nb = blocks - u * F32_BLOCKS < F32_BLOCKS ? (int)(blocks - u * F32_BLOCKS) : F32_BLOCKS;
            const int64_t end = (g + 1) * F32_GROUP_ROWS < m ? (g + 1) * F32_GROUP_ROWS : m;
            for (int64_t r = g * F32_GROUP_ROWS; r < end; r += F32_ROWS)
                f32_chunk(x + r * k, k, packed + u * F32_BLOCKS * k * 16, nb,
                          end - r < F32_ROWS ? (int)(end - r) : F32_ROWS, r == g * F32_GROUP_ROWS,
                          bias ? bias + col : bias, out + r * n + col, n, n - col);
        }
}

#else

int linear_f32_available(void) { return 0; }
void pack_f32_weight(const float *w, float *packed, int64_t n, int64_t k) { (void)w; (void)packed; (void)n; (void)k; }
void linear_f32(const float *x, const float *packed, const float *bias, float *out, int64_t m, int64_t n, int64_t k)
{ (void)x; (void)packed; (void)bias; (void)out; (void)m; (void)n; (void)k; }

#endif
