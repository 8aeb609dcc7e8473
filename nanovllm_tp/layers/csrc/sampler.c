/* Rank 0's sampler on CPU, over fp32 logits: per-row top-k, logprobs, and one pass per entry that applies the
 * entry's logit modifiers (allowed set, grammar mask, biases, penalties, suppressed tokens), then takes the argmax
 * or draws (temperature, top-k, min-p, top-p, Gumbel-max), and gives the logprobs. Built with cpu_kernels.c into
 * one library (nanovllm_tp/layers/cpu_kernels.py); nanovllm_tp/layers/sampler.py holds the same operations in
 * numpy/torch: their reference, and the path off the CPU.
 *
 * Built with -ffast-math, yet exact where the reference is: suppressed logits are -inf, so orderings go through
 * integer keys and exp's argument is clamped; divisions go through double, which rounds to the float32 quotient
 * whatever reciprocal math does; the noise is the reference's counter-based uniforms, bit for bit.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PARALLEL_MIN_ELEMENTS 65536    /* below this the entries stay on the calling thread */
#define INLINE static inline __attribute__((always_inline))

/* ---------------------------------------------------------------- top-k per row
 * A row's k largest values (k <= cols), best first; of equal values the lower column comes first. Values are
 * compared as integer keys that order floats exactly, -inf (a suppressed logit) included.
 * The maximum of each block of 16 columns; the k-th largest of those maxima is a threshold that at least k values
 * reach (one per such block), so only blocks whose maximum reaches it are read again, and only values reaching it
 * are inserted into the sorted list of the best k so far (about 1-2 k insertions on logits).
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

/* ---------------------------------------------------------------- helpers
 */
INLINE float key_value(uint32_t key)
{
    const uint32_t u = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE float clamped_exp(float d) { return expf(d > -100.0f ? d : -100.0f); }

INLINE float div_exact(float a, float b) { return (float)((double)a / (double)b); }

INLINE int is_finite_or_max(uint32_t key) { return key >= order_key(-FLT_MAX); }    /* not -inf (nor NaN below) */

INLINE uint64_t splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* -log(-log(u)) for sampler.uniform_noise's u of (row key, vocab id) */
INLINE double gumbel(uint64_t row_key, int64_t id)
{
    const uint64_t bits = splitmix64(row_key ^ splitmix64((uint64_t)id)) >> 11;
    return -log(-log(((double)bits + 0.5) * (1.0 / 9007199254740992.0)));
}

/* the largest key of a row (a vectorised reduction) */
static uint32_t max_key(const float *row, int64_t cols)
{
    uint32_t top = 0;
    for (int64_t c = 0; c < cols; c++) {
        const uint32_t key = order_key(row[c]);
        top = key > top ? key : top;
    }
    return top;
}

/* the first column holding the row's largest value: the maximum, then the first block of 64 holding it (each
 * block's test a vectorised reduction), then its place in the block */
static int64_t argmax_row(const float *row, int64_t cols)
{
    const uint32_t top = max_key(row, cols);
    for (int64_t b = 0; b < cols; b += 64) {
        const int64_t end = b + 64 < cols ? b + 64 : cols;
        int hit = 0;
        for (int64_t c = b; c < end; c++) hit |= order_key(row[c]) == top;
        if (hit)
            for (int64_t c = b; c < end; c++)
                if (order_key(row[c]) == top) return c;
    }
    return 0;
}

/* ---------------------------------------------------------------- logprobs
 * One row's logsumexp-normalised figures at column `chosen`: logprob, rank (1 + the columns with a larger logit)
 * and, with top_n > 0, its top_n best columns and their logprobs. Returns -1 if scratch fails.
 */
static int logprob_row(const float *row, int64_t cols, int64_t chosen, int top_n, float *logprob, int64_t *rank,
                       float *top_logprobs, int64_t *top_ids)
{
    const float m = key_value(max_key(row, cols)), picked = row[chosen];
    float sum = 0.0f;
    int64_t above = 0;
    for (int64_t c = 0; c < cols; c++) {
        sum += clamped_exp(row[c] - m);
        above += row[c] > picked;
    }
    const float lse = m + logf(sum);
    *logprob = picked - lse;
    *rank = above + 1;
    if (top_n <= 0) return 0;
    uint32_t *maxima;
    topk_entry *best = topk_scratch(cols, top_n, &maxima);
    if (!best) return -1;
    topk_row(row, cols, top_n, maxima, best);
    for (int i = 0; i < top_n; i++) {
        top_logprobs[i] = row[best[i].col] - lse;
        top_ids[i] = best[i].col;
    }
    free(maxima);
    free(best);
    return 0;
}

/* For each entry r: row row_of[r] of x at column chosen[r] (prompt logprobs). */
int row_logprobs(const float *x, int64_t rows, int64_t cols, int64_t stride, const int64_t *row_of,
                 const int64_t *chosen, int top_n, float *logprob, int64_t *rank, float *top_logprobs,
                 int64_t *top_ids)
{
    int failed = 0;
    #pragma omp parallel for if (rows * cols >= PARALLEL_MIN_ELEMENTS) schedule(static) reduction(|:failed)
    for (int64_t r = 0; r < rows; r++)
        failed |= logprob_row(x + row_of[r] * stride, cols, chosen[r], top_n, logprob + r, rank + r,
                              top_logprobs + r * top_n, top_ids + r * top_n);
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------- one entry's token
 * An entry's knobs come from the scheduler's ROW_DTYPE records, at the byte offsets the caller gives in this
 * order (and with these types: sampler.py checks them against ROW_DTYPE).
 */
enum { F_TEMPERATURE, F_TOP_P, F_TOP_K, F_MIN_P, F_SEED, F_LOGPROBS, F_REPETITION, F_FREQUENCY, F_PRESENCE,
       NUM_FIELDS };

typedef struct {
    float temperature, top_p, min_p, repetition, frequency, presence;
    int32_t top_k, logprobs;
    int64_t seed;
} knobs_t;

static knobs_t read_knobs(const char *rec, const int64_t *off)
{
    knobs_t k;
    memcpy(&k.temperature, rec + off[F_TEMPERATURE], 4);
    memcpy(&k.top_p, rec + off[F_TOP_P], 4);
    memcpy(&k.top_k, rec + off[F_TOP_K], 4);
    memcpy(&k.min_p, rec + off[F_MIN_P], 4);
    memcpy(&k.seed, rec + off[F_SEED], 8);
    memcpy(&k.logprobs, rec + off[F_LOGPROBS], 4);
    memcpy(&k.repetition, rec + off[F_REPETITION], 4);
    memcpy(&k.frequency, rec + off[F_FREQUENCY], 4);
    memcpy(&k.presence, rec + off[F_PRESENCE], 4);
    return k;
}

/* ---------------------------------------------------------------- logit modifiers
 * An entry's items (token, kind, value), kinds as scheduler/rows.py numbers them, applied kind by kind: ALLOW
 * (only those tokens keep their logit), MASK (token: a row of the step's bitmasks, `words` uint32 words each; a
 * column whose bit is clear, or past the mask, becomes -inf), BIAS (+ value), PENALTY (value: the token's count
 * in the output), SUPPRESS (-inf). A logit that is -inf stays so. Each op rounded as float32 numpy rounds it: no
 * fused multiply-adds.
 */
enum { MOD_PENALTY, MOD_SUPPRESS, MOD_BIAS, MOD_ALLOW, MOD_MASK };

/* row[c] <- src[c] where bit c of mask is set, else -inf (also past its words); src may be row. Word by word: a
 * grammar's mask is mostly empty words (a run of -inf) and, inside strings, full ones (a copy). */
static void masked_copy(float *row, const float *src, int64_t cols, const uint32_t *mask, int64_t words)
{
    for (int64_t c0 = 0; c0 < cols; c0 += 32) {
        const int64_t n = cols - c0 < 32 ? cols - c0 : 32;
        const uint32_t bits = c0 / 32 < words ? mask[c0 / 32] : 0u;
        if (bits == 0u) {
            for (int64_t i = 0; i < n; i++) row[c0 + i] = -INFINITY;
        } else if (bits == 0xffffffffu) {
            if (row != src) memcpy(row + c0, src + c0, sizeof(float) * (size_t)n);
        } else {
            for (int64_t i = 0; i < n; i++) row[c0 + i] = (bits >> i) & 1u ? src[c0 + i] : -INFINITY;
        }
    }
}

INLINE int is_masked(float v) { return !is_finite_or_max(order_key(v)); }

/* row <- the entry's modified copy of raw */
static void modify(float *row, const float *raw, int64_t cols, const int64_t *token, const int32_t *kind,
                   const float *value, int64_t n, const knobs_t *k, const int32_t *masks, int64_t words)
{
    int allow_only = 0, biased = 0;
    int64_t first_mask = -1;
    for (int64_t i = 0; i < n; i++) {
        allow_only |= kind[i] == MOD_ALLOW;
        biased |= kind[i] == MOD_BIAS;
        if (kind[i] == MOD_MASK && first_mask < 0) first_mask = i;
    }
    if (allow_only) {
        for (int64_t c = 0; c < cols; c++) row[c] = -INFINITY;
        for (int64_t i = 0; i < n; i++)
            if (kind[i] == MOD_ALLOW) row[token[i]] = raw[token[i]];
    } else if (first_mask >= 0) {             /* the copy and the first mask in one pass */
        masked_copy(row, raw, cols, (const uint32_t *)(masks + token[first_mask] * words), words);
    } else {
        memcpy(row, raw, sizeof(float) * (size_t)cols);
    }
    for (int64_t i = 0; i < n; i++)
        if (kind[i] == MOD_MASK && (allow_only || i != first_mask))
            masked_copy(row, row, cols, (const uint32_t *)(masks + token[i] * words), words);
    for (int64_t i = 0; biased && i < n; i++) {
        float *v = row + token[i];
        if (kind[i] != MOD_BIAS || is_masked(*v)) continue;
        volatile float biased = *v + value[i];
        *v = biased;
    }
    for (int64_t i = 0; i < n; i++) {
        float *v = row + token[i];
        if (kind[i] != MOD_PENALTY || is_masked(*v)) continue;
        volatile float scaled = *v > 0.0f ? div_exact(*v, k->repetition) : *v * k->repetition;
        volatile float by_count = k->frequency * value[i];
        volatile float by_presence = value[i] > 0.0f ? k->presence : 0.0f;
        volatile float penalty = by_count + by_presence;
        *v = scaled - penalty;
    }
    for (int64_t i = 0; i < n; i++)
        if (kind[i] == MOD_SUPPRESS) row[token[i]] = -INFINITY;
}

/* min-p's floor under the best scaled logit: p < min_p * p_max <=> s < top + log(min_p). min_p = 1 keeps the
 * maxima exactly (the fast-math logf(1) need not be 0). */
INLINE float min_p_floor(float top, float min_p)
{
    return min_p >= 1.0f ? top : top + logf(min_p);
}

/* how many columns of row have a key of at least `key` */
static int64_t count_at_least(const float *row, int64_t cols, uint32_t key)
{
    int64_t n = 0;
    for (int64_t c = 0; c < cols; c++) n += order_key(row[c]) >= key;
    return n;
}

/* How many of n sorted scaled candidates (best first) min-p and top-p keep (at least one); total: the softmax
 * mass, relative to vals[0], of everything min-p keeps (over the candidates themselves when < 0). */
static int keep_prefix(const float *vals, int n, const knobs_t *k, float total)
{
    int keep = n;
    if (k->min_p > 0.0f) {
        const float floor = min_p_floor(vals[0], k->min_p);
        for (int i = 1; i < keep; i++)
            if (vals[i] < floor) {
                keep = i;
                break;
            }
    }
    if (k->top_p < 1.0f) {
        if (total < 0.0f) {
            total = 0.0f;
            for (int i = 0; i < keep; i++) total += clamped_exp(vals[i] - vals[0]);
        }
        float mass = 0.0f;
        for (int i = 0; i < keep; i++) {
            if (i > 0 && mass / total >= k->top_p) return i;
            mass += clamped_exp(vals[i] - vals[0]);
        }
    }
    return keep;
}

/* Gumbel-max among the first n sorted candidates */
static int64_t draw_among(const float *vals, const topk_entry *best, int n, uint64_t row_key)
{
    double top = 0.0;
    int pick = 0;
    for (int i = 0; i < n; i++) {
        const double score = (double)vals[i] + gumbel(row_key, best[i].col);
        if (i == 0 || score > top) {
            top = score;
            pick = i;
        }
    }
    return best[pick].col;
}

/* the k best of row, scaled, into vals (finite ones only: returns how many) */
static int scaled_candidates(const float *row, int64_t cols, int k, float temperature, uint32_t *maxima,
                             topk_entry *best, float *vals)
{
    topk_row(row, cols, k, maxima, best);
    int n = 1;
    while (n < k && is_finite_or_max(best[n].key)) n++;
    for (int i = 0; i < n; i++) vals[i] = div_exact(row[best[i].col], temperature);
    return n;
}

/* A draw at the entry's temperature: among its top_k best (0 < top_k < cols; with the ties of the k-th), else
 * over the whole vocabulary, where top-p takes the best 64, 128, ... until the kept mass is reached. A row of nothing but -inf gives column 0 (the
 * argmax; the candidate draws take their first candidate, the lowest column of equal keys). Returns -1 if scratch
 * fails. */
static int64_t draw_row(const float *row, int64_t cols, const knobs_t *k, int64_t counter)
{
    const uint64_t row_key = splitmix64(splitmix64((uint64_t)k->seed) ^ (uint64_t)counter);
    const int limited = k->top_k > 0 && k->top_k < cols;
    /* over the vocabulary: the largest scaled logit, and min-p's floor below it */
    const float raw_top = limited ? 0.0f : key_value(max_key(row, cols));
    const float top = div_exact(raw_top, k->temperature);
    const float floor = !limited && k->min_p > 0.0f ? min_p_floor(top, k->min_p) : -FLT_MAX;
    if (!limited && k->top_p >= 1.0f) {            /* every token that min-p keeps is a candidate */
        double best = 0.0;
        int64_t pick = -1;
        for (int64_t c = 0; c < cols; c++) {
            if (!is_finite_or_max(order_key(row[c]))) continue;
            const float s = div_exact(row[c], k->temperature);
            if (s < floor && row[c] < raw_top) continue;    /* min-p never drops a maximum */
            const double score = (double)s + gumbel(row_key, c);
            if (pick < 0 || score > best) {
                best = score;
                pick = c;
            }
        }
        return pick >= 0 ? pick : argmax_row(row, cols);
    }
    float total = -1.0f;
    /* top-k takes one candidate past the k-th: whether it equals the k-th says if the k-th best has ties */
    int want = limited ? k->top_k + 1 : (cols < 64 ? (int)cols : 64);
    if (!limited) {                                /* top-p over the vocabulary: its mass, after min-p */
        total = 0.0f;
        for (int64_t c = 0; c < cols; c++) {
            const float s = div_exact(row[c], k->temperature);
            total += s >= floor ? clamped_exp(s - top) : 0.0f;
        }
    }
    for (;;) {
        uint32_t *maxima;
        topk_entry *best = topk_scratch(cols, want, &maxima);
        float *vals = malloc(sizeof(float) * (size_t)want);
        if (!best || !vals) {
            if (best) {
                free(maxima);
                free(best);
            }
            free(vals);
            return -1;
        }
        int n = scaled_candidates(row, cols, want, k->temperature, maxima, best, vals);
        if (limited && n > k->top_k) {   /* top-k keeps every token equal to the k-th best too (transformers, vLLM) */
            const uint32_t kth = best[k->top_k - 1].key;
            const int64_t tied = best[k->top_k].key == kth ? count_at_least(row, cols, kth) : k->top_k;
            if (tied > want) {
                free(maxima);
                free(best);
                free(vals);
                want = (int)tied;
                continue;
            }
            n = (int)tied;
        }
        const int keep = keep_prefix(vals, n, k, total);
        const int done = limited || keep < n || n < want || want == cols;
        const int64_t token = done ? draw_among(vals, best, keep, row_key) : -1;
        free(maxima);
        free(best);
        free(vals);
        if (done) return token;
        want = 2 * (int64_t)want < cols ? 2 * want : (int)cols;
    }
}

/* a row buffer of at least cols floats, one per thread, grown when needed and kept (NULL if allocation fails) */
static float *scratch_row(int64_t cols)
{
    static __thread float *buf = NULL;
    static __thread int64_t capacity = 0;
    if (capacity < cols) {
        free(buf);
        buf = malloc(sizeof(float) * (size_t)cols);
        capacity = buf ? cols : 0;
    }
    return buf;
}

/* ---------------------------------------------------------------- a step's entries
 *   x [rows, cols] fp32 logits (row stride `stride`); entry e reads row row_of[e]
 *   records: the entries' ROW_DTYPE records (record_size bytes apart), offsets: their fields (enum above)
 *   counter [entries]: tokens each entry generated before (the noise counter)
 *   mod_start [entries + 1], mod_token, mod_kind, mod_value: each entry's logit modifiers, in a CSR layout
 *   masks [*, words]: the bitmasks MASK items point at (grammars; NULL when there are none)
 * Out: tokens [entries]; for the entries with logprobs >= 0, in entry order: logprob, rank, and the top_n best of
 * the raw row (top_n = the largest logprobs asked). Rows are read, never written (a modified row is a copy). An
 * entry whose modifiers leave no logit above -inf takes the argmax of what is left (column 0), drawn or not.
 * Returns -1 if scratch fails.
 */
int sample_rows(const float *x, int64_t stride, int64_t cols, int64_t entries, const int64_t *row_of,
                const char *records, int64_t record_size, const int64_t *offsets, const int64_t *counter,
                const int64_t *mod_start, const int64_t *mod_token, const int32_t *mod_kind, const float *mod_value,
                const int32_t *masks, int64_t words, float min_temperature, int64_t *tokens, int top_n,
                float *logprob, int64_t *rank, float *top_logprobs, int64_t *top_ids)
{
    int64_t *slot = malloc(sizeof(int64_t) * (size_t)(entries > 0 ? entries : 1));
    if (!slot) return -1;
    for (int64_t e = 0, n = 0; e < entries; e++) {
        const knobs_t k = read_knobs(records + e * record_size, offsets);
        slot[e] = k.logprobs >= 0 ? n++ : -1;
    }
    int failed = 0;
    #pragma omp parallel for if (entries * cols >= PARALLEL_MIN_ELEMENTS) schedule(dynamic, 1) reduction(|:failed)
    for (int64_t e = 0; e < entries; e++) {
        const knobs_t k = read_knobs(records + e * record_size, offsets);
        const float *raw = x + row_of[e] * stride, *row = raw;
        float *copy = NULL;        /* this thread's row buffer, kept between calls (no fresh pages per row) */
        const int64_t first = mod_start[e], mods = mod_start[e + 1] - first;
        if (mods > 0) {
            copy = scratch_row(cols);
            if (!copy) {
                failed = 1;
                continue;
            }
            modify(copy, raw, cols, mod_token + first, mod_kind + first, mod_value + first, mods, &k, masks, words);
            row = copy;
        }
        tokens[e] = k.temperature < min_temperature ? argmax_row(row, cols) : draw_row(row, cols, &k, counter[e]);
        failed |= tokens[e] < 0;
        const int64_t s = slot[e];
        if (s >= 0 && !failed)
            failed |= logprob_row(raw, cols, tokens[e], top_n, logprob + s, rank + s, top_logprobs + s * top_n,
                                  top_ids + s * top_n);
    }
    free(slot);
    return failed ? -1 : 0;
}

/* The modified rows alone (what sample_rows draws from): out [entries, cols]; arguments as sample_rows's. */
void modify_rows(const float *x, int64_t stride, int64_t cols, int64_t entries, const int64_t *row_of,
                 const char *records, int64_t record_size, const int64_t *offsets, const int64_t *mod_start,
                 const int64_t *mod_token, const int32_t *mod_kind, const float *mod_value, const int32_t *masks,
                 int64_t words, float *out)
{
    for (int64_t e = 0; e < entries; e++) {
        const knobs_t k = read_knobs(records + e * record_size, offsets);
        const int64_t first = mod_start[e];
        modify(out + e * cols, x + row_of[e] * stride, cols, mod_token + first, mod_kind + first, mod_value + first,
               mod_start[e + 1] - first, &k, masks, words);
    }
}
