/* The float types every kernel in cpu_kernels.c, decode_attn*.c and lora.c takes: fp32 or, with bf16 != 0, bf16 (the
 * top half of an fp32), computed in fp32. The generic bodies are always inlined with bf16 a constant, so each dtype
 * gets its own vectorised loop; bf16 is widened by a shift and rounded to nearest even on the way back.
 */
#ifndef NANOVLLM_TP_DTYPES_H
#define NANOVLLM_TP_DTYPES_H
#include <stdint.h>
#include <string.h>

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

#endif
