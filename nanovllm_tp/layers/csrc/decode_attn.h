/* decode_attn.c's paged_decode (called by decoder.c too) and fp8 tables, and decode_attn_simd.c's entry point. */
#ifndef NANOVLLM_TP_DECODE_ATTN_H
#define NANOVLLM_TP_DECODE_ATTN_H
#include <stdint.h>

/* fp8 code -> fp32, exact, for e4m3 and e5m2 (their NaN and inf codes, which a scaled store never writes, read as
 * 0): filled by decode_attn.c when the library loads */
extern float fp8_e4m3_values[256], fp8_e5m2_values[256];

#define DECODE_NO_SIMD (-2)     /* paged_decode_simd's answer when this build or head_dim has no vector form */

/* portable != 0: the plain loop even where the vector form runs (for comparisons); 0, or -1 (no scratch memory) */
int paged_decode(const void *q, const void *k_cache, const void *v_cache, const float *k_scale,
                 const float *v_scale, const int32_t *tables, int64_t table_stride, const int32_t *lens, void *out,
                 int rows, int heads, int kv_heads, int dim, int block_size, float scale, int window, float softcap,
                 int bf16, int kv, int portable);

/* paged_decode's arguments (see decode_attn.c); 0, -1 (no scratch memory) or DECODE_NO_SIMD */
int paged_decode_simd(const void *q, const void *k_cache, const void *v_cache, const float *k_scale,
                      const float *v_scale, const int32_t *tables, int64_t table_stride, const int32_t *lens,
                      void *out, int rows, int heads, int kv_heads, int dim, int block_size, float scale, int window,
                      float softcap, int bf16, int kv);

#endif
