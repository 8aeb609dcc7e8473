/* LoRA deltas of a decode step in which the rows run different adapters (nanovllm_tp/lora/layers.py): for each
 * token t whose slot s = slot[t] is not -1, y[t] += B[s] (A[s] x[t]), fp32, reading only the rank rows and columns
 * the slot's adapter uses. One call per adapted layer replaces a gather and a batched matmul pair in torch.
 *
 * A [slots, parts * R, in] and B [slots, out, parts * R] are contiguous; part p (q, k, v of a packed qkv layer)
 * owns the output rows part_rows[p] .. part_rows[p + 1] - 1 and the rank columns p * R .. p * R + rank - 1, with
 * rank = ranks[s * parts + p] (0: the adapter leaves that part alone). x and y rows are x_stride / y_stride apart.
 */
#include <stdint.h>

static inline float dot(const float *a, const float *b, int64_t n)
{
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

void lora_gathered(const float *x, float *y, const float *A, const float *B, const int64_t *slot,
                   const int64_t *ranks, const int64_t *part_rows, int64_t tokens, int64_t in, int64_t out,
                   int64_t x_stride, int64_t y_stride, int parts, int64_t R)
{
    const int64_t W = parts * R;
#pragma omp parallel for schedule(static) if (tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t s = slot[t];
        if (s < 0)
            continue;
        float h[W];
        const float *xt = x + t * x_stride;
        float *yt = y + t * y_stride;
        for (int p = 0; p < parts; p++) {
            const int64_t rank = ranks[s * parts + p];
            const float *a = A + (s * W + p * R) * in;
            for (int64_t w = 0; w < rank; w++)
                h[p * R + w] = dot(a + w * in, xt, in);
        }
        for (int p = 0; p < parts; p++) {
            const int64_t rank = ranks[s * parts + p];
            if (rank == 0)
                continue;
            const float *b = B + s * out * W + p * R;
            for (int64_t o = part_rows[p]; o < part_rows[p + 1]; o++)
                yt[o] += dot(b + o * W, h + p * R, rank);
        }
    }
}
