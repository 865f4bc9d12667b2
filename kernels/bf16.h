/* bf16 <-> fp32 for the native CPU kernels (the kernels/ C sources): scalar, and AVX-512 where the
 * compiler targets it. Kernels load bf16 and accumulate in fp32. */
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

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
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
#endif

#endif /* SWITCHBOARD_BF16_H */
