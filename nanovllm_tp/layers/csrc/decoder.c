/* A decode step's decoder layers (every row one new token): the kernels the layer modules call one by one
 * (rms_norm, the linear layers and their LoRA deltas, rope, kv_store into a quantized cache, paged_decode,
 * silu_mul; layer_kernels.h), called here in the same order on the same operands, so the results are the modules'
 * to the bit. What is left out is what each module call costs around its kernel on one stream: the Python, the
 * ctypes call, the fresh tensors and the views, per piece of every layer.
 *
 * A layer is eight pieces in the modules' order (the enum below): input norm, qkv, attend (q/k norms, rope, K/V into
 * their slots, paged decode), o, post-attention norm, gate/up, SiLU-and-mul, down. decoder_run runs a range of
 * them over a table of layers, so the caller decides where to stop: nowhere (one call for every layer of one rank
 * whose linears all run here), at the all-reduces after o and down (TP), and around a linear run by the caller
 * (kind LINEAR_CALLER: oneDNN-packed, or a merged layer of two quantized types, which the caller runs through
 * torch's or the modules' matmul on the scratch rows, then resumes).
 *
 * The layers are described once (layer_desc, filled by nanovllm_tp/models/fused_decode.py from the modules'
 * packed weights and the layer's KV cache); a step passes its rows' positions, KV slots, block tables and lengths,
 * and the scratch rows that pass between the pieces (scratch_desc, the caller's: it reads and writes them around
 * its own linears). hidden [rows, hidden] holds a layer's input and gets its output; residual [rows, hidden] is
 * the running sum.
 */
#include <stdint.h>
#include <string.h>

#include "decode_attn.h"
#include "dtypes.h"
#include "layer_kernels.h"
#include "lora.h"

enum { LINEAR_CALLER = 0, LINEAR_QUANT = 1, LINEAR_DENSE = 2 };
enum { INPUT_NORM, QKV, ATTEND, O, POST_NORM, GATE_UP, ACT, DOWN, PIECES };

typedef struct {
    const void *packed;      /* linear_q's layout (LINEAR_QUANT) or linear.c's, in the activations' dtype */
    const void *bias;        /* NULL, or [n]: fp32 for a quantized weight, the activations' dtype for a dense one */
    const lora_tables *lora; /* NULL, or the layer's LoRA slot tables: each adapted row's delta added after it */
    int64_t n, k;
    int32_t kind, qtype;     /* kind LINEAR_CALLER: run by the caller, the rest unused */
} linear_desc;

typedef struct {
    linear_desc qkv, o, gate_up, down;
    const void *input_norm, *post_norm;     /* [hidden] in the activations' dtype */
    const void *q_norm, *k_norm;            /* [dim], or NULL: no q/k norms */
    const void *cos_sin;                    /* [max_position, rot_dim] */
    void *k_cache, *v_cache;                /* [blocks, block_size, kv_heads, dim]: the activations' dtype, or */
    float *k_scale, *v_scale;               /* 8-bit (kv != 0) with these scales [blocks, block_size, kv_heads] */
    float eps, qk_eps, scale, softcap;
    int32_t heads, kv_heads, dim, rot_dim, block_size, window, cos_bf16, hidden;
    int32_t kv;                             /* 0: dense cache; 1 int8, 2 fp8 e4m3, 3 fp8 e5m2 (cpu_kernels.KV_CODES) */
} layer_desc;

typedef struct {             /* one step's rows */
    const int64_t *positions, *slots;
    const int32_t *tables, *lens;
    const lora_groups *lora; /* NULL, or the rows with an adapter, grouped by slot */
    int64_t table_stride, rows;
    int32_t bf16, first;     /* first: hidden is the embedding (no residual yet) */
} step_desc;

typedef struct {             /* what passes between the pieces, each [rows, width] with contiguous rows */
    void *h;                 /* a norm's output: qkv's and gate/up's input [rows, hidden] */
    void *qkv;               /* [rows, qkv.n] */
    void *q;                 /* the queries of qkv, rows contiguous for paged_decode [rows, heads * dim] */
    void *attn;              /* paged_decode's output: o's input [rows, heads * dim] */
    void *gate_up;           /* [rows, gate_up.n] */
    void *act;               /* SiLU(gate) * up: down's input [rows, down.k] */
} scratch_desc;

/* out = x W^T (+ bias), then the LoRA deltas of the step's adapted rows, as LinearBase.forward and
 * LoRALayer.apply do: x [rows, k] and out [rows, n] contiguous */
static int run_linear(const linear_desc *l, const void *x, void *out, const step_desc *s)
{
    const int64_t m = s->rows;
    int failed = 0;
    if (l->kind == LINEAR_QUANT) failed = linear_q(x, l->packed, l->bias, out, m, l->n, l->k, l->qtype, s->bf16);
    else if (l->kind != LINEAR_DENSE) return -1;       /* the caller's to run */
    else if (s->bf16) linear_bf16(x, l->packed, l->bias, out, m, l->n, l->k);
    else linear_f32(x, l->packed, l->bias, out, m, l->n, l->k);
    if (l->lora && s->lora) failed |= lora_apply(l->lora, s->lora, x, out, l->k, l->n, s->bf16);
    return failed;
}

/* q/k norms, rope, K and V into their slots, paged decode: qkv's rows to o's input */
static int attend(const layer_desc *L, const scratch_desc *b, const step_desc *s)
{
    const int64_t m = s->rows, nq = L->qkv.n, es = ELEM_SIZE(s->bf16);
    const int64_t qd = (int64_t)L->heads * L->dim, kvd = (int64_t)L->kv_heads * L->dim;
    char *qkv = b->qkv;
    if (L->q_norm) {         /* in place: each head of each row its own norm */
        rms_norm(qkv, NULL, L->q_norm, qkv, m, L->heads, nq, nq, L->dim, L->qk_eps, s->bf16);
        rms_norm(qkv + qd * es, NULL, L->k_norm, qkv + qd * es, m, L->kv_heads, nq, nq, L->dim, L->qk_eps, s->bf16);
    }
    rope(qkv, qkv + qd * es, s->positions, L->cos_sin, m, L->heads, L->kv_heads, nq, nq, L->dim, L->rot_dim,
         s->bf16, L->cos_bf16);
    if (L->kv) {             /* K, then V, quantized into their slots, as Attention's store_quantized does */
        kv_store(qkv + qd * es, nq, s->slots, L->k_cache, L->k_scale, m, L->kv_heads, L->dim, s->bf16, L->kv, 0);
        kv_store(qkv + (qd + kvd) * es, nq, s->slots, L->v_cache, L->v_scale, m, L->kv_heads, L->dim, s->bf16, L->kv,
                 0);
    }
    for (int64_t t = 0; t < m; t++) {
        const char *row = qkv + t * nq * es;
        if (!L->kv) {
            memcpy((char *)L->k_cache + s->slots[t] * kvd * es, row + qd * es, (size_t)(kvd * es));
            memcpy((char *)L->v_cache + s->slots[t] * kvd * es, row + (qd + kvd) * es, (size_t)(kvd * es));
        }
        memcpy((char *)b->q + t * qd * es, row, (size_t)(qd * es));
    }
    return paged_decode(b->q, L->k_cache, L->v_cache, L->k_scale, L->v_scale, s->tables, s->table_stride, s->lens,
                        b->attn, (int)m, L->heads, L->kv_heads, L->dim, L->block_size, L->scale, L->window,
                        L->softcap, s->bf16, L->kv, 0);
}

/* pieces first .. last - 1 of layers (piece p: layers[p / PIECES]'s piece p % PIECES), in order. Returns 0, or -1
 * when a kernel cannot allocate its scratch (or a piece is a linear of the caller's). */
int decoder_run(const layer_desc *layers, int64_t first, int64_t last, void *hidden, void *residual,
                const scratch_desc *b, const step_desc *s)
{
    const int64_t m = s->rows;
    int failed = 0;
    for (int64_t p = first; p < last && !failed; p++) {
        const layer_desc *L = layers + p / PIECES;
        const int64_t H = L->hidden;
        switch (p % PIECES) {
        case INPUT_NORM:     /* residual += hidden first, except where hidden is the embedding */
            if (p < PIECES && s->first) {
                rms_norm(hidden, NULL, L->input_norm, b->h, m, 1, H, H, (int)H, L->eps, s->bf16);
                memcpy(residual, hidden, (size_t)(m * H * ELEM_SIZE(s->bf16)));
            } else {
                rms_norm(hidden, residual, L->input_norm, b->h, m, 1, H, H, (int)H, L->eps, s->bf16);
            }
            break;
        case QKV: failed = run_linear(&L->qkv, b->h, b->qkv, s); break;
        case ATTEND: failed = attend(L, b, s); break;
        case O: failed = run_linear(&L->o, b->attn, hidden, s); break;    /* TP: before its all-reduce */
        case POST_NORM: rms_norm(hidden, residual, L->post_norm, b->h, m, 1, H, H, (int)H, L->eps, s->bf16); break;
        case GATE_UP: failed = run_linear(&L->gate_up, b->h, b->gate_up, s); break;
        case ACT: silu_mul(b->gate_up, b->act, m, L->down.k, s->bf16); break;
        case DOWN: failed = run_linear(&L->down, b->act, hidden, s); break;
        }
    }
    return failed ? -1 : 0;
}
