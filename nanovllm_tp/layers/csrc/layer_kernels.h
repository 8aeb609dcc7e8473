/* The layer kernels decoder.c calls in a decode step's order: declared once here, included by the files that
 * define them (cpu_kernels.c, kv_store.c, linear.c, linear_q.c) and by decoder.c, so a signature that changes on
 * one side fails to compile instead of passing the wrong arguments. */
#ifndef NANOVLLM_TP_LAYER_KERNELS_H
#define NANOVLLM_TP_LAYER_KERNELS_H
#include <stdint.h>

int linear_q(const void *x, const uint8_t *packed, const float *bias, void *out, int64_t m, int64_t n, int64_t k,
             int qtype, int bf16);
void linear_f32(const float *x, const float *packed, const float *bias, float *out, int64_t m, int64_t n, int64_t k);
void linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *out, int64_t m,
                 int64_t n, int64_t k);
void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t outer, int64_t inner,
              int64_t x_stride, int64_t out_stride, int size, float eps, int bf16);
void rope(void *q, void *k, const int64_t *positions, const void *cos_sin, int64_t tokens, int q_heads,
          int k_heads, int64_t q_stride, int64_t k_stride, int dim, int rot_dim, int bf16, int cos_bf16);
void silu_mul(const void *x, void *out, int64_t tokens, int64_t width, int bf16);
/* kv: 1 int8, 2 fp8 e4m3, 3 fp8 e5m2 (cpu_kernels.KV_CODES) */
void kv_store(void *x, int64_t x_stride, const int64_t *slots, void *cache, float *scales, int64_t tokens, int heads,
              int dim, int bf16, int kv, int readback);

#endif
