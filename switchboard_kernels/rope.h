/* RoPE over a row's heads in place, as the torch path computes it (worker/model/rope.py
 * `apply_rope`: `addcmul(x * cos, roll(x, half), signed_sin)`), bit for bit: shared by
 * rope_cpu.c (a step's rows) and decode_step_cpu.c (its one-call decode step). */
#ifndef SWITCHBOARD_ROPE_H
#define SWITCHBOARD_ROPE_H

#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* fp32: the first product rounded, then the second product and the sum in one FMA (ATen's
 * vectorized addcmul is an fmadd). */
static inline void rope_heads_f32(float *x, int64_t count, int64_t hd, const float *cos,
                                  const float *ssin) {
    const int64_t half = hd / 2;
    for (int64_t h = 0; h < count; h++, x += hd) {
        float wide[hd];
        for (int64_t i = 0; i < hd; i++) wide[i] = x[i];
#pragma omp simd
        for (int64_t i = 0; i < half; i++) x[i] = fmaf(wide[i + half], ssin[i], wide[i] * cos[i]);
#pragma omp simd
        for (int64_t i = half; i < hd; i++) x[i] = fmaf(wide[i - half], ssin[i], wide[i] * cos[i]);
    }
}

/* bf16: `x * cos` rounded to bf16, then its sum with `roll(x) * signed_sin` (a product of two
 * bf16 values, exact in fp32) rounded once. */
static inline void rope_heads_bf16(uint16_t *x, int64_t count, int64_t hd, const uint16_t *cos,
                                   const uint16_t *ssin) {
    const int64_t half = hd / 2;
    for (int64_t h = 0; h < count; h++, x += hd) {
        float wide[hd];
#pragma omp simd
        for (int64_t i = 0; i < hd; i++) wide[i] = bf16_to_f32(x[i]);
#pragma omp simd
        for (int64_t i = 0; i < hd; i++) {
            float scaled = bf16_to_f32(f32_to_bf16(wide[i] * bf16_to_f32(cos[i])));
            float turned = wide[i < half ? i + half : i - half] * bf16_to_f32(ssin[i]);
            x[i] = f32_to_bf16(scaled + turned);
        }
    }
}

#endif /* SWITCHBOARD_ROPE_H */
