/* SwiGLU's silu(gate) * up on one row, bf16 or fp32, rounded as torch's two ops round it: the
 * loops of activation_cpu.c, shared with the grouped experts of moe_bf16_cpu.c / moe_f32_cpu.c.
 * The AVX-512 loop where the build has AVX-512 (unless portable), else the plain one. */
#ifndef SWITCHBOARD_SWIGLU_H
#define SWITCHBOARD_SWIGLU_H

#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "exp_avx512.h"

/* e^x for x <= 0, plain C (x = n ln2 + f ln2, |f| <= 1/2, 2^f by its Taylor polynomial, then
 * scaled by 2^n with ldexpf, which keeps subnormal results as the AVX-512 loop's scalef does). */
static inline float exp_nonpositive_f32(float x) {
    float t = (x < -104.0f ? -104.0f : x) * 1.44269504089f;
    float n = floorf(t + 0.5f);
    float f = (t - n) * 0.69314718056f;
    float p = 1.0f / 720;
    p = p * f + 1.0f / 120;
    p = p * f + 1.0f / 24;
    p = p * f + 1.0f / 6;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    return ldexpf(p, (int)n);
}

/* silu(x) = x * sigmoid(x), with e = e^-|x| so that nothing overflows:
 * sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) below. */
static inline float silu_f32(float x) {
    float e = exp_nonpositive_f32(-fabsf(x));
    return x * ((x >= 0.0f ? 1.0f : e) / (1.0f + e));
}

#if defined(__AVX512F__)
static inline __m512 silu16(__m512 x) {
    __m512 magnitude = _mm512_abs_ps(x);
    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), magnitude));
    __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 numerator = _mm512_mask_blend_ps(negative, _mm512_set1_ps(1.0f), e);
    __m512 sigmoid = _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    return _mm512_mul_ps(x, sigmoid);
}

/* bf16(x) as fp32: the rounding torch's bf16 op applies between silu and the product. */
static inline __m512 round_to_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pack_bf16(v)), 16));
}
#endif

/* y[c] = bf16(bf16(silu(gate[c])) * up[c]) for c < dim. */
static inline void silu_mul_row_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *y,
                                     int64_t dim, int portable) {
    (void)portable; /* without AVX-512 only the plain loop exists */
    int64_t c = 0;
#if defined(__AVX512F__)
    if (!portable)
        for (; c < dim; c += 16) {
            __mmask16 m = tail_mask(dim - c);
            __m512 act = round_to_bf16(silu16(load_bf16(gate + c, m)));
            store_bf16(y + c, _mm512_mul_ps(act, load_bf16(up + c, m)), m);
        }
#endif
    for (; c < dim; c++) {
        float act = bf16_to_f32(f32_to_bf16(silu_f32(bf16_to_f32(gate[c]))));
        y[c] = f32_to_bf16(act * bf16_to_f32(up[c]));
    }
}

/* y[c] = silu(gate[c]) * up[c] in fp32 for c < dim. */
static inline void silu_mul_row_f32(const float *gate, const float *up, float *y, int64_t dim,
                                    int portable) {
    (void)portable;
    int64_t c = 0;
#if defined(__AVX512F__)
    if (!portable)
        for (; c < dim; c += 16) {
            __mmask16 m = tail_mask(dim - c);
            __m512 act = silu16(_mm512_maskz_loadu_ps(m, gate + c));
            _mm512_mask_storeu_ps(y + c, m, _mm512_mul_ps(act, _mm512_maskz_loadu_ps(m, up + c)));
        }
#endif
    for (; c < dim; c++) y[c] = silu_f32(gate[c]) * up[c];
}

#endif /* SWITCHBOARD_SWIGLU_H */
