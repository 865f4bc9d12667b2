/* SwiGLU's silu(gate) * up on one row, bf16 or fp32, rounded as torch's two ops round it: the
 * loops of activation_cpu.c, shared with the grouped experts of moe_bf16_cpu.c / moe_f32_cpu.c.
 * The AVX-512 loop where the build has AVX-512 (unless portable), else the plain one. */
#ifndef SWITCHBOARD_SWIGLU_H
#define SWITCHBOARD_SWIGLU_H

#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
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

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* The AVX2 loop: exp_nonpositive_f32 and silu_f32 on 8 lanes, step for step (n by
 * floor(t + 1/2), 2^n applied in two halves so that subnormal results round once, as ldexpf). */
static inline __m256 exp_nonpositive8(__m256 x) {
    __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)),
                             _mm256_set1_ps(1.44269504089f));
    __m256 n = _mm256_floor_ps(_mm256_add_ps(t, _mm256_set1_ps(0.5f)));
    __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718056f));
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i ni = _mm256_cvtps_epi32(n); /* in [-150, 0] */
    __m256i half = _mm256_srai_epi32(ni, 1), rest = _mm256_sub_epi32(ni, half);
    __m256i bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

static inline __m256 silu8(__m256 x) {
    __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_setzero_ps(), magnitude));
    __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    __m256 numerator = _mm256_blendv_ps(_mm256_set1_ps(1.0f), e, negative);
    return _mm256_mul_ps(x, _mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
}

static inline __m256 load8_bf16(const uint16_t *p) {
    __m128i raw = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

/* v rounded to bf16 as f32_to_bf16 rounds (nearest even, NaN kept), in 8 halves. */
static inline __m128i pack8_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    rounded = _mm256_blendv_epi8(rounded, quiet, nan);
    __m256i halves = _mm256_srli_epi32(rounded, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1));
}
/* bf16(v) as fp32: the rounding between silu and the product (round_to_bf16's 8 lanes). */
static inline __m256 round8_to_bf16(__m256 v) {
    __m128i packed = pack8_bf16(v);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(packed), 16));
}
#define SWIGLU_AVX2 1
#endif

/* y[c] = bf16(bf16(silu(gate[c])) * up[c]) for c < dim. */
static inline void silu_mul_row_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *y,
                                     int64_t dim, int portable) {
    (void)portable; /* without AVX-512 or AVX2 only the plain loop exists */
    int64_t c = 0;
#if defined(__AVX512F__)
    if (!portable)
        for (; c < dim; c += 16) {
            __mmask16 m = tail_mask(dim - c);
            __m512 act = round_to_bf16(silu16(load_bf16(gate + c, m)));
            store_bf16(y + c, _mm512_mul_ps(act, load_bf16(up + c, m)), m);
        }
#elif defined(SWIGLU_AVX2)
    if (!portable)
        for (; c + 8 <= dim; c += 8) {
            __m256 act = round8_to_bf16(silu8(load8_bf16(gate + c)));
            __m128i out = pack8_bf16(_mm256_mul_ps(act, load8_bf16(up + c)));
            _mm_storeu_si128((__m128i *)(y + c), out);
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
#elif defined(SWIGLU_AVX2)
    if (!portable)
        for (; c + 8 <= dim; c += 8)
            _mm256_storeu_ps(y + c, _mm256_mul_ps(silu8(_mm256_loadu_ps(gate + c)),
                                                  _mm256_loadu_ps(up + c)));
#endif
    for (; c < dim; c++) y[c] = silu_f32(gate[c]) * up[c];
}

#endif /* SWITCHBOARD_SWIGLU_H */
