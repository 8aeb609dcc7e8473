/* Paged decode attention for CPU (fp32): one query token per row attends to its K/V in place in the paged
 * cache, so nothing is gathered or padded. Layouts match the engine's cache:
 *   q, out   [rows, heads, dim]
 *   k/v      [num_blocks, block_size, kv_heads, dim]
 *   tables   [rows, table_stride] int32 block ids, lens [rows] int32 context lengths
 * Query heads that share a kv head (GQA) are handled together, so each K/V vector is read once per row.
 * Work is split over (row, kv head) pairs with OpenMP; built against the libgomp torch has loaded, it
 * shares torch's thread pool and follows torch.set_num_threads.
 * Built with -ffast-math (vectorised dot products and expf): no infinities are used, -FLT_MAX stands in.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16     /* query heads per kv head handled in one pass; larger groups loop over chunks */

static inline __attribute__((always_inline)) void
attend(const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int len, int group,
       int64_t head_offset, int64_t token_stride, const int dim, int block_size, float scale, float *scores,
       float *out)
{
    memset(out, 0, sizeof(float) * group * dim);
    if (len <= 0) return;     /* a padding row attends to nothing */
    const int blocks = (len + block_size - 1) / block_size;
    /* scores[g * len + t] = scale * <q_g, k_t> */
    for (int b = 0; b < blocks; b++) {
        const int64_t base = (int64_t)table[b] * block_size * token_stride + head_offset;
        const int n = len - b * block_size < block_size ? len - b * block_size : block_size;
        for (int i = 0; i < n; i++) {
            const float *k = k_cache + base + i * token_stride;
            for (int g = 0; g < group; g++) {
                const float *qg = q + (int64_t)g * dim;
                float dot = 0.f;
                for (int d = 0; d < dim; d++) dot += qg[d] * k[d];
                scores[(int64_t)g * len + b * block_size + i] = dot * scale;
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float *s = scores + (int64_t)g * len;
        float max = -FLT_MAX, sum = 0.f;
        for (int t = 0; t < len; t++) max = s[t] > max ? s[t] : max;
        for (int t = 0; t < len; t++) { s[t] = expf(s[t] - max); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int t = 0; t < len; t++) s[t] *= inv;
    }
    for (int b = 0; b < blocks; b++) {
        const int64_t base = (int64_t)table[b] * block_size * token_stride + head_offset;
        const int n = len - b * block_size < block_size ? len - b * block_size : block_size;
        for (int i = 0; i < n; i++) {
            const float *v = v_cache + base + i * token_stride;
            for (int g = 0; g < group; g++) {
                const float p = scores[(int64_t)g * len + b * block_size + i];
                float *o = out + (int64_t)g * dim;
                for (int d = 0; d < dim; d++) o[d] += p * v[d];
            }
        }
    }
}

/* head_dim is a compile-time constant in the common cases so the inner loops unroll fully */
static void attend_any_dim(const float *q, const float *k_cache, const float *v_cache, const int32_t *table,
                           int len, int group, int64_t head_offset, int64_t token_stride, int dim, int block_size,
                           float scale, float *scores, float *out)
{
    switch (dim) {
    case 64:
        attend(q, k_cache, v_cache, table, len, group, head_offset, token_stride, 64, block_size, scale, scores, out);
        break;
    case 128:
        attend(q, k_cache, v_cache, table, len, group, head_offset, token_stride, 128, block_size, scale, scores, out);
        break;
    case 32:
        attend(q, k_cache, v_cache, table, len, group, head_offset, token_stride, 32, block_size, scale, scores, out);
        break;
    default:
        attend(q, k_cache, v_cache, table, len, group, head_offset, token_stride, dim, block_size, scale, scores, out);
    }
}

int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *tables,
                     int64_t table_stride, const int32_t *lens, float *out, int rows, int heads, int kv_heads,
                     int dim, int block_size, float scale)
{
    const int group = heads / kv_heads;
    const int chunk = group < MAX_GROUP ? group : MAX_GROUP;
    const int64_t token_stride = (int64_t)kv_heads * dim;
    int max_len = 1;
    for (int r = 0; r < rows; r++) max_len = lens[r] > max_len ? lens[r] : max_len;
    int failed = 0;
    #pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)chunk * max_len);
        float *acc = malloc(sizeof(float) * (size_t)chunk * dim);
        /* every thread must reach the worksharing loop, so a thread without buffers only reports it */
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int r = 0; r < rows; r++) {
            for (int h = 0; h < kv_heads; h++) {
                if (!scores || !acc) {
                    #pragma omp atomic write
                    failed = 1;
                    continue;
                }
                for (int g0 = 0; g0 < group; g0 += chunk) {
                    const int n = group - g0 < chunk ? group - g0 : chunk;
                    const int64_t first = ((int64_t)r * heads + (int64_t)h * group + g0) * dim;
                    attend_any_dim(q + first, k_cache, v_cache, tables + (int64_t)r * table_stride, lens[r], n,
                                   (int64_t)h * dim, token_stride, dim, block_size, scale, scores, acc);
                    memcpy(out + first, acc, sizeof(float) * n * dim);
                }
            }
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
