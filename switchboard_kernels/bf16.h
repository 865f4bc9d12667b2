/* bf16 <-> fp32 and fp16 -> fp32 for the native CPU kernels (the switchboard_kernels/ C
 * sources): scalar, and AVX-512 where the compiler targets it. Kernels load bf16 (a quantized
 * weight's scales and zeros fp16 too) and accumulate in fp32. */
#ifndef SWITCHBOARD_BF16_H
#define SWITCHBOARD_BF16_H

#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline float half_to_f32(uint16_t h) { /* fp16 -> fp32, exactly */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        v.f = (float)man * (1.0f / 16777216.0f);
        v.u |= sign;
        return v.f;
    }
    v.u = sign | ((exp + 112u) << 23) | (man << 13); /* inf/NaN never stored */
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* n values of a bf16 (fp32 = 0) or fp32 (fp32 = 1) array as fp32: in place for fp32, else
 * widened into buf. For kernels that take either dtype with one fp32 inner loop. */
static inline const float *as_f32(const void *p, int64_t n, int fp32, float *buf) {
    if (fp32) return (const float *)p;
    const uint16_t *h = (const uint16_t *)p;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) buf[i] = bf16_to_f32(h[i]);
    return buf;
}

#if defined(__AVX512F__)
/* Lanes [0, left) of a 16-lane vector. */
static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

/* 16 bf16 (the lanes in m; others 0) as fp32. */
static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) {
    __m256i raw = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* v rounded to bf16 (nearest even, NaN kept as NaN), packed in 16 halves. */
static inline __m256i pack_bf16(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else /* round to nearest even by hand; a NaN's payload could round up into infinity */
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

/* The lanes in m of v, rounded to bf16 (nearest even). */
static inline void store_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, pack_bf16(v));
}
#endif

#endif /* SWITCHBOARD_BF16_H */
