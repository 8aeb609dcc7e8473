/* LoRA deltas of a step of few tokens per row (decode, speculative verify, a prompt's last token) in which the
 * rows run different adapters (nanovllm_tp/lora/layers.py): for each token t whose slot s = slot[t] is not -1,
 * y[t] += B[s] (A[s] x[t]), reading only the rank rows and columns the slot's adapter uses. One call per adapted
 * layer replaces a matmul pair per run of rows in torch. fp32, or with bf16 != 0 every float operand bf16 (h and
 * the sums in fp32, y rounded to nearest even once).
 *
 * A [slots, parts * R, in] and B [slots, parts * R, out] (transposed: the expand step is an axpy over
 * contiguous outputs per rank, with no horizontal sums) are contiguous; part p (q, k, v of a packed qkv layer)
 * owns the outputs part_rows[p] .. part_rows[p + 1] - 1 and the rank rows p * R .. p * R + rank - 1, with
 * rank = ranks[s * parts + p] (0: the adapter leaves that part alone). x and y rows are x_stride / y_stride apart.
 */
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float ld(const void *p, int64_t i, const int bf16)
{
    if (!bf16)
        return ((const float *)p)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE void st(void *p, int64_t i, float f, const int bf16)
{
    if (!bf16) {
        ((float *)p)[i] = f;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
}

INLINE float dot(const void *a, int64_t a0, const void *b, int64_t b0, int64_t n, const int bf16a, const int bf16b)
{
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++)
        s += ld(a, a0 + i, bf16a) * ld(b, b0 + i, bf16b);
    return s;
}

INLINE void lora_body(const void *x, void *y, const void *A, const void *B, const int64_t *slot,
                      const int64_t *ranks, const int64_t *part_rows, int64_t tokens, int64_t in, int64_t x_stride,
                      int64_t y_stride, int parts, int64_t R, int64_t out, const int bf16)
{
    const int64_t W = parts * R;
#pragma omp parallel for schedule(static) if (tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t s = slot[t];
        if (s < 0)
            continue;
        float acc[bf16 ? out : 1];          /* bf16: the sums before y's one rounding */
        float *sum = bf16 ? acc : (float *)y + t * y_stride;
        if (bf16)
            for (int64_t o = 0; o < out; o++)
                acc[o] = ld(y, t * y_stride + o, 1);
        for (int p = 0; p < parts; p++) {
            const int64_t rank = ranks[s * parts + p], lo = part_rows[p], hi = part_rows[p + 1];
            for (int64_t w = 0; w < rank; w++) {
                const float h = dot(A, (s * W + p * R + w) * in, x, t * x_stride, in, bf16, bf16);
                const int64_t b0 = (s * W + p * R + w) * out;
#pragma omp simd
                for (int64_t o = lo; o < hi; o++)
                    sum[o] += h * ld(B, b0 + o, bf16);
            }
        }
        if (bf16)
            for (int64_t o = 0; o < out; o++)
                st(y, t * y_stride + o, acc[o], 1);
    }
}

void lora_gathered(const void *x, void *y, const void *A, const void *B, const int64_t *slot, const int64_t *ranks,
                   const int64_t *part_rows, int64_t tokens, int64_t in, int64_t out, int64_t x_stride,
                   int64_t y_stride, int parts, int64_t R, int bf16)
{
    if (bf16)
        lora_body(x, y, A, B, slot, ranks, part_rows, tokens, in, x_stride, y_stride, parts, R, out, 1);
    else
        lora_body(x, y, A, B, slot, ranks, part_rows, tokens, in, x_stride, y_stride, parts, R, out, 0);
}
