/* AVX-512 helpers shared by the linear kernels (linear.c, linear_q.c, lora.c) and decode attention (decode_attn_simd.c). */
#ifndef NANOVLLM_TP_SIMD_H
#define NANOVLLM_TP_SIMD_H
#if defined(__AVX512BW__)
#include <immintrin.h>

static inline __m256i to_bf16(__m512 v)     /* fp32 -> bf16, round to nearest even */
{
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

static inline __m512 from_bf16(__m256i v)   /* bf16 -> fp32, exact */
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

#endif
#endif
