/* lora.c's entry point as the LoRA layers (nanovllm_tp/lora/layers.py) and decoder.c call it: one adapted
 * layer's slot tables, described once, and a step's tokens grouped by slot, described once a step. */
#ifndef NANOVLLM_TP_LORA_H
#define NANOVLLM_TP_LORA_H
#include <stdint.h>

typedef struct {            /* a LoRALayer's tables on this rank (see lora.c for the layouts) */
    const void *A, *B;
    const int64_t *ranks, *part_rows;
    int64_t in, out, R;
    int32_t parts, bf16;     /* bf16: A and B are bf16 (else fp32) */
} lora_tables;

typedef struct {            /* a SlotGroups: tokens in slot order, each group's first index, its slot */
    const int64_t *order, *starts, *slots;
    int64_t groups;
} lora_groups;

/* y[t] += B[s] (A[s] x[t]) for the grouped tokens (lora_gathered); x and y rows x_stride / y_stride apart, in
 * bf16 when x_bf16 (else fp32). 0, or 1 when scratch cannot be allocated (nothing written). */
int lora_apply(const lora_tables *t, const lora_groups *g, const void *x, void *y, int64_t x_stride,
               int64_t y_stride, int x_bf16);

#endif
