/* LoRA deltas of a step whose rows run different adapters (nanovllm_tp/lora/layers.py): for each token t whose
 * slot s is not -1, y[t] += B[s] (A[s] x[t]), reading only the rank rows and columns the slot's adapter uses.
 * One call per adapted layer, any number of tokens (decode, speculative verify rows, prompt chunks): lora_apply
 * (lora.h), from LoRALayer.apply and from decoder.c's fused layers alike.
 *
 * The tokens come grouped by slot: order[starts[g] .. starts[g + 1] - 1] are the tokens of group g, whose slot is
 * group_slot[g]. A group's adapter is read from memory once per call whatever its number of tokens, so the call
 * costs about one pass over the adapters in use: the step is bound by reading them.
 *
 * A [slots, parts * R, in] and B [slots, parts * R, out] (B transposed) are contiguous; part p (q, k, v of a
 * packed qkv layer) owns the outputs part_rows[p] .. part_rows[p + 1] - 1 and the rank rows p * R .. p * R +
 * rank - 1, rank = ranks[s * parts + p] (0: the adapter leaves that part alone). x and y rows are x_stride /
 * y_stride apart and share one dtype (x_bf16); A and B share another (w_bf16): fp32 or bf16 each, every product
 * and sum in fp32, y rounded (bf16: to nearest even) once.
 *
 * Two passes. Shrink: h[i] = A x for the i-th grouped token, all rank rows of a part in one pass over x (x's chunk
 * of 16 in a register, one accumulator per rank row, one transpose-reduce of the 16 accumulators at the end).
 * Expand: y += h B over units of 64 outputs, adapter by adapter: a token's sums in registers, the unit's rank rows
 * of B read from memory once (the unit two ahead prefetched into L2) and from cache for the group's other tokens.
 * Threads split the shrink over (group, part, blocks of TB tokens) and the expand over units, so a step of one
 * row still spreads. Without AVX-512 the same two passes run in plain C (the sums in the same precision).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "lora.h"

#define PARALLEL_MIN_MACS (1 << 17)
#define TB 8              /* tokens of one group per shrink task */
#define UNIT 64           /* outputs per expand unit (threads split the units) */
#define PREFETCH 8        /* shrink: chunks of 16 inputs ahead */
#define PREFETCH_UNITS 2  /* expand: units ahead (into L2) */

INLINE const void *at(const void *p, int64_t i, const int bf16) { return (const char *)p + (bf16 ? 2 : 4) * i; }

typedef struct {
    const void *x, *A, *B;
    void *y;
    const int64_t *order, *starts, *group_slot, *ranks, *part_rows;
    int64_t groups, in, out, x_stride, y_stride, R;
    int parts;
    float *h;             /* [grouped tokens, parts * R] */
} Lora;

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "simd.h"

INLINE __m512 load16(const void *p, int64_t i, const int bf16, __mmask16 m)
{
    if (bf16)
        return from_bf16(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i));
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

INLINE __mmask16 tail(int64_t left) { return left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1); }

INLINE __m512 pair_sums(__m512 a, __m512 b)      /* per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 */
{
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

INLINE __m512 quad_sums(__m512 c, __m512 d)      /* per lane: the lane sums of the 4 vectors of c and d */
{
    return _mm512_add_ps(_mm512_shuffle_ps(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
}

INLINE __m512 lane_sums(__m512 u, __m512 v)      /* lanes 0+1 and 2+3 of u, then of v */
{
    return _mm512_add_ps(_mm512_shuffle_f32x4(u, v, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u, v, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* element j: the sum of the 16 elements of acc[j] */
INLINE __m512 transpose_reduce(const __m512 acc[16])
{
    __m512 s[8], u[4];
    for (int j = 0; j < 8; j++) s[j] = pair_sums(acc[2 * j], acc[2 * j + 1]);
    for (int j = 0; j < 4; j++) u[j] = quad_sums(s[2 * j], s[2 * j + 1]);
    return lane_sums(lane_sums(u[0], u[1]), lane_sums(u[2], u[3]));
}

/* h[w] = rows[w] . x for w < nb (<= 16), rows `in` apart: x's chunk of 16 in a register against the chunk of
 * every row (an accumulator each, the rows prefetched PREFETCH chunks ahead: prefetches never fault), the 16
 * accumulators reduced together at the end */
INLINE void shrink_block(const void *x, const void *rows, int64_t in, const int nb, float *h, const int xb,
                         const int wb)
{
    __m512 acc[16];
    for (int w = 0; w < 16; w++) acc[w] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) {
        const __mmask16 m = tail(in - i);
        const __m512 xv = load16(x, i, xb, m);
        #pragma GCC unroll 16
        for (int w = 0; w < 16; w++)
            if (w < nb) {
                _mm_prefetch(at(rows, w * in + i + PREFETCH * 16, wb), _MM_HINT_T0);
                acc[w] = _mm512_fmadd_ps(load16(rows, w * in + i, wb, m), xv, acc[w]);
            }
    }
    _mm512_mask_storeu_ps(h, (__mmask16)((1u << nb) - 1), transpose_reduce(acc));
}

/* h[t][w] = A[w] . x[t] for the rows w < rank of a and nt tokens, one token at a time (the first reads A from
 * memory, the others from cache) */
INLINE void shrink_tokens(const Lora *L, const void *a, int rank, const int64_t *tok, int nt, float *h,
                          const int xb, const int wb)
{
    const int64_t in = L->in, W = L->parts * L->R;
    for (int t = 0; t < nt; t++) {
        const void *x = at(L->x, tok[t] * L->x_stride, xb);
        for (int w0 = 0; w0 < rank; w0 += 16) {
            const void *rows = at(a, (int64_t)w0 * in, wb);
            if (rank - w0 >= 16)
                shrink_block(x, rows, in, 16, h + t * W + w0, xb, wb);
            else
                shrink_block(x, rows, in, rank - w0, h + t * W + w0, xb, wb);
        }
    }
}

/* y[t][o .. o + n) += sum over w < rank of h[t][w] * b[w][o ..] (n <= UNIT) for nt tokens, one token at a time:
 * the unit's sums in registers, the rank rows of b read from memory for the first token (the unit PREFETCH_UNITS
 * ahead prefetched) and from cache for the others; y read and written once */
INLINE void expand_unit(const Lora *L, const void *b, int rank, int64_t o, const int64_t *tok, int nt,
                        const float *h, const __mmask16 *m, const int xb, const int wb)
{
    const int64_t W = L->parts * L->R;
    for (int t = 0; t < nt; t++) {
        __m512 acc[UNIT / 16];
        const int64_t y0 = tok[t] * L->y_stride + o;
        #pragma GCC unroll 4
        for (int c = 0; c < UNIT / 16; c++) acc[c] = load16(L->y, y0 + 16 * c, xb, m[c]);
        const float *ht = h + t * W;
        for (int w = 0; w < rank; w++) {
            const __m512 hv = _mm512_set1_ps(ht[w]);
            #pragma GCC unroll 4
            for (int c = 0; c < UNIT / 16; c++)
                acc[c] = _mm512_fmadd_ps(hv, load16(b, w * L->out + o + 16 * c, wb, m[c]), acc[c]);
        }
        #pragma GCC unroll 4
        for (int c = 0; c < UNIT / 16; c++) {
            if (xb)
                _mm256_mask_storeu_epi16((uint16_t *)L->y + y0 + 16 * c, m[c], to_bf16(acc[c]));
            else
                _mm512_mask_storeu_ps((float *)L->y + y0 + 16 * c, m[c], acc[c]);
        }
    }
}

INLINE void expand_tokens(const Lora *L, const void *b, int rank, int64_t o, int64_t n, const int64_t *tok, int nt,
                          const float *h, const int xb, const int wb, int64_t end)
{
    const int64_t ahead = o + PREFETCH_UNITS * UNIT;
    if (ahead < end)
        for (int w = 0; w < rank; w++)
            for (int64_t i = 0; i < UNIT; i += wb ? 32 : 16)
                _mm_prefetch(at(b, w * L->out + ahead + i, wb), _MM_HINT_T1);
    static const __mmask16 full[UNIT / 16] = {0xffff, 0xffff, 0xffff, 0xffff};
    if (n == UNIT) {
        expand_unit(L, b, rank, o, tok, nt, h, full, xb, wb);
        return;
    }
    __mmask16 m[UNIT / 16];
    for (int c = 0; c < UNIT / 16; c++) m[c] = tail(n - 16 * c);
    expand_unit(L, b, rank, o, tok, nt, h, m, xb, wb);
}

#else
INLINE void shrink_tokens(const Lora *L, const void *a, int rank, const int64_t *tok, int nt, float *h,
                          const int xb, const int wb)
{
    const int64_t W = L->parts * L->R;
    for (int t = 0; t < nt; t++)
        for (int w = 0; w < rank; w++) {
            float sum = 0.0f;
            for (int64_t i = 0; i < L->in; i++)
                sum += load(a, w * L->in + i, wb) * load(L->x, tok[t] * L->x_stride + i, xb);
            h[t * W + w] = sum;
        }
}

INLINE void expand_tokens(const Lora *L, const void *b, int rank, int64_t o, int64_t n, const int64_t *tok, int nt,
                          const float *h, const int xb, const int wb, int64_t end)
{
    const int64_t W = L->parts * L->R;
    (void)end;
    for (int t = 0; t < nt; t++)
        for (int64_t j = o; j < o + n; j++) {
            float acc = load(L->y, tok[t] * L->y_stride + j, xb);
            for (int w = 0; w < rank; w++)
                acc += h[t * W + w] * load(b, w * L->out + j, wb);
            store(L->y, tok[t] * L->y_stride + j, acc, xb);
        }
}
#endif

INLINE int64_t units_of(const Lora *L, int p) { return (L->part_rows[p + 1] - L->part_rows[p] + UNIT - 1) / UNIT; }

/* blocks[g]: the token blocks (of TB) before group g's */
INLINE void lora_body(const Lora *L, const int64_t *blocks, const int xb, const int wb)
{
    const int64_t W = L->parts * L->R, tokens = L->starts[L->groups];
    int64_t units = 0;        /* expand units over every part */
    for (int p = 0; p < L->parts; p++) units += units_of(L, p);
    #pragma omp parallel if (tokens * W * (L->in + L->out) >= PARALLEL_MIN_MACS)
    {
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t k = 0; k < blocks[L->groups]; k++)
            for (int p = 0; p < L->parts; p++) {
                int64_t g = 0;
                while (blocks[g + 1] <= k) g++;
                const int64_t s = L->group_slot[g], rank = L->ranks[s * L->parts + p];
                const int64_t first = L->starts[g] + (k - blocks[g]) * TB, left = L->starts[g + 1] - first;
                if (rank)
                    shrink_tokens(L, at(L->A, (s * W + p * L->R) * L->in, wb), (int)rank, L->order + first,
                                  left < TB ? (int)left : TB, L->h + first * W + p * L->R, xb, wb);
            }
        /* adapter by adapter (its rows prefetched ahead within it); a unit's outputs stay with one thread */
        for (int64_t g = 0; g < L->groups; g++) {
            const int64_t s = L->group_slot[g], first = L->starts[g];
            #pragma omp for schedule(static) nowait
            for (int64_t u = 0; u < units; u++) {
                int p = 0;
                int64_t k = u;
                while (k >= units_of(L, p)) k -= units_of(L, p++);
                const int64_t rank = L->ranks[s * L->parts + p];
                if (!rank)
                    continue;
                const int64_t o = L->part_rows[p] + k * UNIT, left = L->part_rows[p + 1] - o;
                expand_tokens(L, at(L->B, (s * W + p * L->R) * L->out, wb), (int)rank, o, left < UNIT ? left : UNIT,
                              L->order + first, (int)(L->starts[g + 1] - first), L->h + first * W + p * L->R, xb,
                              wb, L->part_rows[p + 1]);
            }
        }
    }
}

/* returns 1 when the scratch could not be allocated (nothing written), else 0 */
static int lora_gathered(const void *x, void *y, const void *A, const void *B, const int64_t *order, const int64_t *starts,
                  const int64_t *group_slot, int64_t groups, const int64_t *ranks, const int64_t *part_rows,
                  int64_t in, int64_t out, int64_t x_stride, int64_t y_stride, int parts, int64_t R, int x_bf16,
                  int w_bf16)
{
    const int64_t tokens = starts[groups];
    if (!tokens)
        return 0;
    float *h = malloc(sizeof(float) * tokens * parts * R);
    int64_t *blocks = malloc(sizeof(int64_t) * (groups + 1));
    if (!h || !blocks) {
        free(h);
        free(blocks);
        return 1;
    }
    blocks[0] = 0;
    for (int64_t g = 0; g < groups; g++)
        blocks[g + 1] = blocks[g] + (starts[g + 1] - starts[g] + TB - 1) / TB;
    const Lora L = {x, A, B, y, order, starts, group_slot, ranks, part_rows, groups, in, out, x_stride, y_stride, R,
                    parts, h};
    if (x_bf16 && w_bf16) lora_body(&L, blocks, 1, 1);
    else if (x_bf16) lora_body(&L, blocks, 1, 0);
    else if (w_bf16) lora_body(&L, blocks, 0, 1);
    else lora_body(&L, blocks, 0, 0);
    free(h);
    free(blocks);
    return 0;
}

int lora_apply(const lora_tables *t, const lora_groups *g, const void *x, void *y, int64_t x_stride,
               int64_t y_stride, int x_bf16)
{
    return lora_gathered(x, y, t->A, t->B, g->order, g->starts, g->slots, g->groups, t->ranks, t->part_rows, t->in,
                         t->out, x_stride, y_stride, t->parts, t->R, x_bf16, t->bf16);
}
