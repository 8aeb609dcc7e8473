/* fp32 and bf16 CPU kernels for the layers whose torch form is a chain of small ops (each a separate pass over memory
 * and a few microseconds of dispatch): paged decode attention, RMSNorm (with the residual add fused in),
 * neox RoPE and SiLU-and-mul; and the sampler's per-row top-k, logprobs and top-k draw. Loaded with ctypes by nanovllm_tp/layers/cpu_kernels.py.
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

/* ---------------------------------------------------------------- paged decode attention
 * One query token per row attends to its K/V in place in the paged cache: nothing is gathered or padded.
 *   q, out   [rows, heads, dim]
 *   k/v      [num_blocks, block_size, kv_heads, dim]
 *   tables   [rows, table_stride] int32 block ids, lens [rows] int32 context lengths
 * A row is one unit of work. Its blocks are visited once, in order, with an online softmax (running max and
 * sum per head, as flash-decoding does), and the next block is prefetched while this one is used: blocks
 * sit at random places in a large pool, so memory latency, not arithmetic, is what costs.
 */
static inline __attribute__((always_inline)) void
decode_row(const float *q, const void *k_cache, const void *v_cache, const int32_t *table, int len, int heads,
           int kv_heads, const int dim, int block_size, float scale, float *scratch, float *out, const int bf16)
{
    const int group = heads / kv_heads;
    const int64_t token_stride = (int64_t)kv_heads * dim, block_elems = (int64_t)block_size * token_stride;
    const int64_t block_bytes = block_elems * ELEM_SIZE(bf16);
    float *scores = scratch, *running_max = scratch + (int64_t)heads * block_size, *running_sum = running_max + heads;
    memset(out, 0, sizeof(float) * heads * dim);
    for (int h = 0; h < heads; h++) {
        running_max[h] = -FLT_MAX;
        running_sum[h] = 0.f;
    }
    const int blocks = (len + block_size - 1) / block_size;
    for (int b = 0; b < blocks; b++) {
        const void *k_block = AT(k_cache, table[b] * block_elems, bf16);
        const void *v_block = AT(v_cache, table[b] * block_elems, bf16);
        const int n = len - b * block_size < block_size ? len - b * block_size : block_size;
        if (b + 1 < blocks) {
            const char *next_k = AT(k_cache, table[b + 1] * block_elems, bf16);
            const char *next_v = AT(v_cache, table[b + 1] * block_elems, bf16);
            for (int64_t byte = 0; byte < block_bytes; byte += 64) {
                __builtin_prefetch(next_k + byte);
                __builtin_prefetch(next_v + byte);
            }
        }
        for (int i = 0; i < n; i++) {          /* scores[h][i] = scale * <q_h, k_i> */
            for (int kv = 0; kv < kv_heads; kv++) {
                const int64_t k = i * token_stride + kv * dim;
                for (int h = kv * group; h < (kv + 1) * group; h++) {
                    const float *qh = q + (int64_t)h * dim;
                    float dot = 0.f;
                    for (int d = 0; d < dim; d++) dot += qh[d] * load(k_block, k + d, bf16);
                    scores[h * block_size + i] = dot * scale;
                }
            }
        }
        for (int h = 0; h < heads; h++) {      /* fold the block into the running softmax */
            float *s = scores + h * block_size, block_max = running_max[h], sum = 0.f;
            for (int i = 0; i < n; i++) block_max = s[i] > block_max ? s[i] : block_max;
            const float rescale = expf(running_max[h] - block_max);
            for (int i = 0; i < n; i++) {
                s[i] = expf(s[i] - block_max);
                sum += s[i];
            }
            running_sum[h] = running_sum[h] * rescale + sum;
            running_max[h] = block_max;
            float *o = out + (int64_t)h * dim;
            for (int d = 0; d < dim; d++) o[d] *= rescale;
        }
        for (int i = 0; i < n; i++) {          /* out[h] += p[h][i] * v_i */
            for (int kv = 0; kv < kv_heads; kv++) {
                const int64_t v = i * token_stride + kv * dim;
                for (int h = kv * group; h < (kv + 1) * group; h++) {
                    const float p = scores[h * block_size + i];
                    float *o = out + (int64_t)h * dim;
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

/* q, out and the caches in one dtype (fp32, or bf16 when bf16 != 0); tables and lens int32. */
int paged_decode(const void *q, const void *k_cache, const void *v_cache, const int32_t *tables,
                 int64_t table_stride, const int32_t *lens, void *out, int rows, int heads, int kv_heads,
                 int dim, int block_size, float scale, int bf16)
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
            /* head_dim and dtype as compile-time constants in the common cases, so the inner loops unroll */
#define DECODE_ROW(DIM) (bf16 ? decode_row(qr, k_cache, v_cache, table, lens[r], heads, kv_heads, DIM, block_size, \
                                           scale, scratch, acc, 1)                                                 \
                              : decode_row(qr, k_cache, v_cache, table, lens[r], heads, kv_heads, DIM, block_size, \
                                           scale, scratch, acc, 0))
            switch (dim) {
            case 64: DECODE_ROW(64); break;
            case 128: DECODE_ROW(128); break;
            case 32: DECODE_ROW(32); break;
            default: DECODE_ROW(dim);
            }
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
 * q [tokens, q_heads, dim] and k [tokens, k_heads, dim], each with its own token stride, rotated in place.
 * cos_sin [max_position, dim]: the cosines of the dim/2 frequencies, then their sines (bf16 when cos_bf16 != 0:
 * the table keeps its own dtype, as the torch code multiplies by it).
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

INLINE void rope_token(void *q, void *k, const void *cos, int q_heads, int k_heads, int dim, const int bf16,
                       const int cos_bf16)
{
    const int half = dim / 2;
    const void *sin = AT(cos, half, cos_bf16);
    for (int h = 0; h < q_heads; h++) rotate(AT(q, (int64_t)h * dim, bf16), cos, sin, half, bf16, cos_bf16);
    for (int h = 0; h < k_heads; h++) rotate(AT(k, (int64_t)h * dim, bf16), cos, sin, half, bf16, cos_bf16);
}

void rope(void *q, void *k, const int64_t *positions, const void *cos_sin, int64_t tokens, int q_heads,
          int k_heads, int64_t q_stride, int64_t k_stride, int dim, int bf16, int cos_bf16)
{
    #pragma omp parallel for if (tokens * (q_heads + k_heads) * dim >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        void *qt = AT(q, t * q_stride, bf16), *kt = AT(k, t * k_stride, bf16);
        const void *cos = AT(cos_sin, positions[t] * dim, cos_bf16);
        if (bf16 && cos_bf16) rope_token(qt, kt, cos, q_heads, k_heads, dim, 1, 1);
        else if (bf16) rope_token(qt, kt, cos, q_heads, k_heads, dim, 1, 0);
        else if (cos_bf16) rope_token(qt, kt, cos, q_heads, k_heads, dim, 0, 1);
        else rope_token(qt, kt, cos, q_heads, k_heads, dim, 0, 0);
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

/* ---------------------------------------------------------------- top-k per row (the sampler's)
 *   x [rows, cols] fp32 (row stride `stride`) -> vals, ids [rows, k]: each row's k largest, best first; of
 * equal values the lower column comes first. Values are compared as integer keys that order floats exactly, -inf
 * (a masked logit) included, whatever -ffast-math assumes.
 * Per row: the maximum of each block of 16 columns; the k-th largest of those maxima is a threshold that at least
 * k values reach (one per such block), so only blocks whose maximum reaches it are read again, and only values
 * reaching it are inserted into the sorted list of the best k so far (about 1-2 k insertions on logits).
 * Returns -1 if the row's scratch cannot be allocated.
 */
#define TOPK_BLOCK 16

typedef struct { uint32_t key; int32_t col; } topk_entry;

INLINE uint32_t order_key(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* the n-th largest (0-based) of a[0..len), reordering a: quickselect, middle pivot */
static uint32_t nth_largest(uint32_t *a, int64_t len, int64_t n)
{
    int64_t lo = 0, hi = len - 1;
    while (lo < hi) {
        const uint32_t pivot = a[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                const uint32_t t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        if (n <= j) hi = j;
        else if (n >= i) lo = i;
        else return a[n];
    }
    return a[n];
}

/* insert e into best[0..*n) (sorted: larger key first, then lower column), keeping at most k */
INLINE void insert_sorted(topk_entry *best, int *n, int k, topk_entry e)
{
    if (*n == k && e.key <= best[k - 1].key) return;   /* columns come in order: an equal key ranks after */
    int lo = 0, hi = *n;
    while (lo < hi) {                                     /* the first entry e ranks before */
        const int mid = (lo + hi) / 2;
        if (best[mid].key >= e.key) lo = mid + 1;
        else hi = mid;
    }
    const int last = *n < k ? *n : k - 1;
    memmove(best + lo + 1, best + lo, sizeof(topk_entry) * (size_t)(last - lo));
    best[lo] = e;
    if (*n < k) (*n)++;
}

/* the k best of one row into best[0..k) (k <= cols), sorted; maxima: scratch of 2 * blocks */
static void topk_row(const float *row, int64_t cols, int k, uint32_t *maxima, topk_entry *best)
{
    const int64_t blocks = (cols + TOPK_BLOCK - 1) / TOPK_BLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t end = (b + 1) * TOPK_BLOCK < cols ? (b + 1) * TOPK_BLOCK : cols;
        uint32_t m = 0;
        for (int64_t c = b * TOPK_BLOCK; c < end; c++) {
            const uint32_t key = order_key(row[c]);
            m = key > m ? key : m;
        }
        maxima[b] = maxima[blocks + b] = m;
    }
    const uint32_t threshold = k <= blocks ? nth_largest(maxima + blocks, blocks, k - 1) : 0;
    int n = 0;
    for (int64_t b = 0; b < blocks; b++) {
        if (maxima[b] < threshold) continue;
        const int64_t end = (b + 1) * TOPK_BLOCK < cols ? (b + 1) * TOPK_BLOCK : cols;
        for (int64_t c = b * TOPK_BLOCK; c < end; c++) {
            const uint32_t key = order_key(row[c]);
            if (key >= threshold) insert_sorted(best, &n, k, (topk_entry){key, (int32_t)c});
        }
    }
}

/* a row's scratch for topk_row; NULL (nothing held) when it cannot be allocated */
static topk_entry *topk_scratch(int64_t cols, int k, uint32_t **maxima)
{
    *maxima = malloc(sizeof(uint32_t) * (size_t)((cols + TOPK_BLOCK - 1) / TOPK_BLOCK) * 2);
    topk_entry *best = malloc(sizeof(topk_entry) * (size_t)(k > 0 ? k : 1));
    if (*maxima && best) return best;
    free(*maxima);
    free(best);
    return NULL;
}

int topk_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, int k, float *vals, int64_t *ids)
{
    int failed = 0;
    #pragma omp parallel for if (rows * cols >= PARALLEL_MIN_ELEMENTS) schedule(static) reduction(|:failed)
    for (int64_t r = 0; r < rows; r++) {
        uint32_t *maxima;
        topk_entry *best = topk_scratch(cols, k, &maxima);
        if (!best) {
            failed = 1;
            continue;
        }
        const float *row = x + r * stride;
        topk_row(row, cols, k, maxima, best);
        for (int i = 0; i < k; i++) {
            vals[r * k + i] = row[best[i].col];
            ids[r * k + i] = best[i].col;
        }
        free(maxima);
        free(best);
    }
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------- sampler
 * Two passes of rank 0's sampler (fp32 logits [rows, cols], row stride `stride`), one call per step; sampler.py
 * holds the same operations in numpy/torch, the reference and the path off the CPU. Suppressed logits are -inf:
 * maxima go through order keys and exp's argument is clamped, whatever -ffast-math assumes.
 */
INLINE float key_value(uint32_t key)
{
    const uint32_t u = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE float clamped_exp(float d) { return expf(d > -100.0f ? d : -100.0f); }

/* For each entry r, row row_of[r]'s logsumexp-normalised figures at column chosen[r]: logprob, rank (1 + the
 * columns with a larger logit) and, with top_n > 0, its top_n best columns and their logprobs. Returns -1 if
 * scratch fails. */
int row_logprobs(const float *x, int64_t rows, int64_t cols, int64_t stride, const int64_t *row_of,
                 const int64_t *chosen, int top_n, float *logprob, int64_t *rank, float *top_logprobs,
                 int64_t *top_ids)
{
    int failed = 0;
    #pragma omp parallel for if (rows * cols >= PARALLEL_MIN_ELEMENTS) schedule(static) reduction(|:failed)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + row_of[r] * stride;
        uint32_t top = 0;
        for (int64_t c = 0; c < cols; c++) {
            const uint32_t key = order_key(row[c]);
            top = key > top ? key : top;
        }
        const float m = key_value(top), picked = row[chosen[r]];
        float sum = 0.0f;
        int64_t above = 0;
        for (int64_t c = 0; c < cols; c++) {
            sum += clamped_exp(row[c] - m);
            above += row[c] > picked;
        }
        const float lse = m + logf(sum);
        logprob[r] = picked - lse;
        rank[r] = above + 1;
        if (top_n <= 0) continue;
        uint32_t *maxima;
        topk_entry *best = topk_scratch(cols, top_n, &maxima);
        if (!best) {
            failed = 1;
            continue;
        }
        topk_row(row, cols, top_n, maxima, best);
        for (int i = 0; i < top_n; i++) {
            top_logprobs[r * top_n + i] = row[best[i].col] - lse;
            top_ids[r * top_n + i] = best[i].col;
        }
        free(maxima);
        free(best);
    }
    return failed ? -1 : 0;
}

INLINE uint64_t splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* One token per entry e, drawn among the top_k[e] best logits of row row_of[e]: scaled by 1/temperature, min-p
 * (drop a candidate below max + log(min_p)), top-p (drop those after the kept mass reached top_p; the first
 * stays), then Gumbel-max with sampler.uniform_noise's counter-based uniforms of (seed, counter, vocab id), bit
 * for bit. top_k[e] <= cols. Returns -1 if scratch fails. */
int draw_top_k(const float *x, int64_t entries, int64_t cols, int64_t stride, const int64_t *row_of,
               const int32_t *top_k, const float *temperature, const float *min_p, const float *top_p,
               const int64_t *seed, const int64_t *counter, int64_t *out)
{
    int failed = 0;
    #pragma omp parallel for if (entries * cols >= PARALLEL_MIN_ELEMENTS) schedule(static) reduction(|:failed)
    for (int64_t e = 0; e < entries; e++) {
        const int k = top_k[e];
        uint32_t *maxima;
        topk_entry *best = topk_scratch(cols, k, &maxima);
        float *vals = malloc(sizeof(float) * (size_t)k);
        if (!best || !vals) {
            if (best) {
                free(maxima);
                free(best);
            }
            free(vals);
            failed = 1;
            continue;
        }
        const float *row = x + row_of[e] * stride;
        topk_row(row, cols, k, maxima, best);
        int keep = 1;     /* candidates are sorted: each mask keeps a prefix; -inf ones (suppressed) never count */
        while (keep < k && best[keep].key >= order_key(-FLT_MAX)) keep++;
        for (int i = 0; i < keep; i++) vals[i] = row[best[i].col] / temperature[e];
        if (min_p[e] > 0.0f) {
            const float floor = vals[0] + logf(min_p[e]);
            for (int i = 1; i < keep; i++)
                if (vals[i] < floor) {
                    keep = i;
                    break;
                }
        }
        if (top_p[e] < 1.0f) {
            float total = 0.0f, mass = 0.0f;
            for (int i = 0; i < keep; i++) total += clamped_exp(vals[i] - vals[0]);
            for (int i = 0; i < keep; i++) {
                if (i > 0 && mass / total >= top_p[e]) {
                    keep = i;
                    break;
                }
                mass += clamped_exp(vals[i] - vals[0]);
            }
        }
        const uint64_t row_key = splitmix64(splitmix64((uint64_t)seed[e]) ^ (uint64_t)counter[e]);
        double best_score = 0.0;
        int pick = 0;
        for (int i = 0; i < keep; i++) {
            const uint64_t bits = splitmix64(row_key ^ splitmix64((uint64_t)best[i].col)) >> 11;
            const double u = ((double)bits + 0.5) * (1.0 / 9007199254740992.0);
            const double score = (double)vals[i] - log(-log(u));
            if (i == 0 || score > best_score) {
                best_score = score;
                pick = i;
            }
        }
        out[e] = best[pick].col;
        free(maxima);
        free(best);
        free(vals);
    }
    return failed ? -1 : 0;
}

/* The penalties at the (entry, token) pairs that occur (`pairs` of them, token < cols): repetition (a positive
 * logit divided, a negative one multiplied), then frequency * count + presence * (count > 0) subtracted; the knobs
 * are per entry, x row e is entry e. Rounded as float32 numpy rounds each op: divisions through double (exact
 * after rounding, whatever -ffast-math makes of them) and no fused multiply-adds. */
void apply_penalties(float *x, int64_t stride, int64_t pairs, const int64_t *entry, const int64_t *token,
                     const float *count, const float *repetition, const float *frequency, const float *presence)
{
    for (int64_t i = 0; i < pairs; i++) {
        const int64_t e = entry[i];
        float *v = x + e * stride + token[i];
        volatile float value = *v > 0.0f ? (float)((double)*v / (double)repetition[e]) : *v * repetition[e];
        volatile float by_count = frequency[e] * count[i];
        volatile float by_presence = count[i] > 0.0f ? presence[e] : 0.0f;
        volatile float penalty = by_count + by_presence;
        *v = value - penalty;
    }
}
