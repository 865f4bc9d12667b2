/* The lane layout of packed weight levels, shared by the 4-bit draft kernels (q4.h: levels
 * times int8 activations) and the quantized-base kernels (wq_cpu.c: levels times fp32
 * activations). switchboard_kernels/panel_levels.py packs it.
 *
 * A panel is PL_NR consecutive output features (the last one zero-padded); its input features
 * run in groups, each group's levels in steps of 64 bytes, one 32-bit lane per output. In a
 * step, lane j of a 4-bit weight holds 8 features k0 .. k0 + 7: byte i = q[j, k0 + i] |
 * q[j, k0 + 4 + i] << 4; of an 8-bit weight 4 features: byte i = q[j, k0 + i]. So an integer
 * dot product (VNNI's vpdpbusd, AVX2's maddubs) takes 4 consecutive features of a lane at
 * once, and a shift and a mask of the lanes give one feature's level for all 16 outputs. */
#ifndef SWITCHBOARD_PANEL_LEVELS_H
#define SWITCHBOARD_PANEL_LEVELS_H

#include <stdint.h>

#include "bf16.h"

#define PL_NR 16         /* outputs per panel: one 32-bit lane each in 64 bytes */
#define PL_STEP_BYTES 64 /* one step of levels: 8 features (4-bit) or 4 (8-bit) */

/* Features per 64-byte step of levels. */
#define PL_STEP_FEATURES(bits) (bits == 4 ? 8 : 4)

/* One row of a panel's tile into y at element ``at``: acc + bias + res, stored as fp32
 * (out_fp32: res fp32 too) or rounded once to bf16 (res bf16); bias and res nullable. */
static inline void pl_store_row(const float *acc, int cols, const float *bias, const void *res,
                                void *y, int64_t at, int out_fp32) {
    for (int j = 0; j < cols; j++) {
        float v = acc[j] + (bias ? bias[j] : 0.0f);
        if (out_fp32) {
            if (res) v += ((const float *)res)[at + j];
            ((float *)y)[at + j] = v;
        } else {
            if (res) v += bf16_to_f32(((const uint16_t *)res)[at + j]);
            ((uint16_t *)y)[at + j] = f32_to_bf16(v);
        }
    }
}

#endif /* SWITCHBOARD_PANEL_LEVELS_H */
