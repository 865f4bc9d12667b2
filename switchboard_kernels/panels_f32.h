/* The fp32 (and int8) weight panels of linear_cpu.c and the tiles that multiply fp32 rows by
 * them, shared with the grouped experts of moe_f32_cpu.c (each expert's projection is such a
 * panel set).
 *
 * Layout: panel p holds W[16p : 16p + 16, :] as [K][16] (k-major: one 64-byte line of
 * weights per input feature), the last panel zero-padded; int8 panels the same with one byte
 * a weight, and scales[16 * num_panels] with W[n, k] ~ q[n, k] * scales[n].
 *
 * Written with GCC's vector extensions (8 floats): the compiler maps them to AVX/AVX2+FMA,
 * AVX-512's lower half, or NEON pairs, so one source serves every CPU. A micro-tile keeps
 * MR rows x 16 outputs in 2 * MR registers; each weight vector loaded serves every row.
 */
#ifndef SWITCHBOARD_PANELS_F32_H
#define SWITCHBOARD_PANELS_F32_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int8_t v8i8 __attribute__((vector_size(8)));
typedef int32_t v8i32 __attribute__((vector_size(32)));

#define NR 16 /* outputs per panel */
#define MR 6  /* rows per micro-tile: 12 accumulators, 2 weight vectors, 1 broadcast */

static inline v8f load_f32(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v8f load_i8(const int8_t *p) {
#if defined(__AVX2__)
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    v8i8 q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(__builtin_convertvector(q, v8i32), v8f);
#endif
}

/* The output columns [n0, n0 + cols) of rows [0, rows): acc (* scale) + bias + residual. */
static inline void store_tile(v8f acc[][2], int rows, int cols, const float *scale,
                              const float *bias, const float *res, int64_t ldr, float *y,
                              int64_t ldy) {
    for (int m = 0; m < rows; m++) {
        float out[NR];
        memcpy(out, acc[m], sizeof out);
        for (int j = 0; j < cols; j++) {
            float v = scale ? out[j] * scale[j] : out[j];
            if (bias) v += bias[j];
            if (res) v += res[m * ldr + j];
            y[m * ldy + j] = v;
        }
    }
}

/* acc[m] = sum_k x[m, k] * panel[k, :] for ROWS rows; ROWS is a constant at every call site,
 * so the accumulators live in registers. Meanwhile the tile prefetches pf_lines cache lines
 * from pf, spread evenly over its k loop: the row groups of one panel together fetch the
 * next panel, so memory streams while the cores compute (else a step of 16 rows cost the
 * bytes' time plus the arithmetic's, not the larger of the two). */
#define DEFINE_TILE(NAME, WTYPE, LOAD)                                                        \
    static inline __attribute__((always_inline)) void NAME(                                   \
        const float *x, int64_t ldx, const WTYPE *panel, int64_t K, const char *pf,           \
        int64_t pf_lines, int fixed_order, int rows, v8f acc[MR][2]) {                        \
        for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = (v8f){0};                      \
        int64_t due = 0, k = 0;                                                               \
        if (rows == 1 && !fixed_order) {                                                      \
            /* one row: two k at a time into two more sums, or each sum's chain of FMAs      \
             * (4 cycles each) would bound the loop, int8 weights most */                     \
            v8f odd0 = {0}, odd1 = {0};                                                       \
            for (; k + 1 < K; k += 2) {                                                       \
                due += 2 * pf_lines;                                                          \
                for (; due >= K; due -= K, pf += 64) __builtin_prefetch(pf);                  \
                float x0 = x[k], x1 = x[k + 1];                                               \
                acc[0][0] += LOAD(panel + k * NR) * x0;                                       \
                acc[0][1] += LOAD(panel + k * NR + 8) * x0;                                   \
                odd0 += LOAD(panel + (k + 1) * NR) * x1;                                      \
                odd1 += LOAD(panel + (k + 1) * NR + 8) * x1;                                  \
            }                                                                                 \
            acc[0][0] += odd0;                                                                \
            acc[0][1] += odd1;                                                                \
        }                                                                                     \
        for (; k < K; k++) {                                                                  \
            due += pf_lines;                                                                  \
            if (due >= K) {                                                                   \
                due -= K;                                                                     \
                __builtin_prefetch(pf);                                                       \
                pf += 64;                                                                     \
            }                                                                                 \
            v8f w0 = LOAD(panel + k * NR), w1 = LOAD(panel + k * NR + 8);                     \
            for (int m = 0; m < rows; m++) {                                                  \
                float xv = x[m * ldx + k];                                                    \
                acc[m][0] += w0 * xv;                                                         \
                acc[m][1] += w1 * xv;                                                         \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_TILE(tile_f32, float, load_f32)
DEFINE_TILE(tile_i8, int8_t, load_i8)

#define DISPATCH_ROWS(TILE, ...)                                                              \
    switch (rows) {                                                                           \
    case 1: TILE(__VA_ARGS__, 1, acc); break;                                                  \
    case 2: TILE(__VA_ARGS__, 2, acc); break;                                                  \
    case 3: TILE(__VA_ARGS__, 3, acc); break;                                                  \
    case 4: TILE(__VA_ARGS__, 4, acc); break;                                                  \
    case 5: TILE(__VA_ARGS__, 5, acc); break;                                                  \
    default: TILE(__VA_ARGS__, 6, acc); break;                                                 \
    }

/* One projection, as switchboard_kernels/linear_native.py lays it out (its PanelLinear): fixed at load,
 * so a call passes five arguments (each argument costs time through ctypes). */
struct sb_panels {
    int64_t in_features, out_features;
    const void *panels; /* [ceil(out / 16)][in][16], fp32 or int8 */
    const float *scales; /* [16 * panels] for int8 panels, else NULL */
    const float *bias;   /* [out] or NULL */
    /* 1: a lone row sums in the order of a tile of many (batch-invariant); 0: two chains */
    int64_t fixed_order;
};

/* Panel p of y[m, n] = sum_k x[m, k] W[n, k] (* scales[n]) (+ bias[n]) (+ res[m, n]) for
 * m < M: the columns [16p, 16p + 16), while next_lines cache lines from next are fetched
 * (the panel after this one). */
static inline void f32_panel(const float *x, int64_t M, int64_t K, const void *panels,
                             int is_int8, const float *scales, int64_t N, const float *bias,
                             const float *res, int fixed_order, float *y, int64_t p,
                             const char *next, int64_t next_lines) {
    int64_t groups = (M + MR - 1) / MR;
    int64_t n0 = p * NR;
    int cols = N - n0 < NR ? (int)(N - n0) : NR;
    const float *sp = is_int8 ? scales + n0 : NULL;
    const float *bp = bias ? bias + n0 : NULL;
    for (int64_t m0 = 0, g = 0; m0 < M; m0 += MR, g++) {
        int rows = M - m0 < MR ? (int)(M - m0) : MR;
        int64_t first = next_lines * g / groups, last = next_lines * (g + 1) / groups;
        const char *pf = next + 64 * first;
        v8f acc[MR][2];
        const float *xm = x + m0 * K;
        if (is_int8) {
            const int8_t *panel = (const int8_t *)panels + p * K * NR;
            DISPATCH_ROWS(tile_i8, xm, K, panel, K, pf, last - first, fixed_order)
        } else {
            const float *panel = (const float *)panels + p * K * NR;
            DISPATCH_ROWS(tile_f32, xm, K, panel, K, pf, last - first, fixed_order)
        }
        store_tile(acc, rows, cols, sp, bp, res ? res + m0 * N + n0 : NULL, N, y + m0 * N + n0,
                   N);
    }
}

#endif /* SWITCHBOARD_PANELS_F32_H */
