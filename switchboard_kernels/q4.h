/* 4-bit weights times int8-rounded rows (see q4_cpu.c for why and the format): the layout,
 * the rows' rounding and the panel loops, shared by q4_cpu.c (one projection a call) and
 * draft_cpu.c (a draft model's whole decode pass in one call). */
#ifndef SWITCHBOARD_Q4_H
#define SWITCHBOARD_Q4_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "panel_levels.h"

#define Q4_NR PL_NR
#define Q4_GROUP 64
#define Q4_OCTETS (Q4_GROUP / 8)
#define Q4_BLOCK (Q4_OCTETS * 64 + 2 * Q4_NR * 2)
#define ROW_TILE 4 /* rows sharing each weight load */

/* One projection as q4_native.py lays it out, fixed at load. */
struct sb_q4 {
    int64_t in_features, out_features; /* in_features a multiple of Q4_GROUP */
    const uint8_t *blocks;             /* [ceil(out / 16)][in / 64][Q4_BLOCK] */
    const float *bias;                 /* [out] or NULL */
};

/* The step's rows as int8 levels per group: x[m, k] ~ q[m, k] * scale[m, g]; sum[m, g] is
 * scale[m, g] * sum_k q[m, k] over the group (what the weights' lows multiply). */
typedef struct {
    int8_t *q;
    float *scale, *sum;
    int64_t K, G;
} Q4Rows;

static int q4_rows_alloc(Q4Rows *r, int64_t rows, int64_t K) {
    r->K = K, r->G = K / Q4_GROUP;
    r->q = malloc((size_t)(rows * K));
    r->scale = malloc(sizeof(float) * (size_t)(rows * r->G));
    r->sum = malloc(sizeof(float) * (size_t)(rows * r->G));
    if (r->q && r->scale && r->sum) return 0;
    free(r->q), free(r->scale), free(r->sum);
    r->q = NULL, r->scale = r->sum = NULL;
    return -1;
}

static void q4_rows_free(Q4Rows *r) { free(r->q), free(r->scale), free(r->sum); }

/* Rounds each group of 64 values of each row to int8 levels (nearest, ties away from 0). */
static void q4_quantize_rows(const void *x, int x_fp32, int64_t rows, Q4Rows *r) {
    int64_t K = r->K, G = r->G;
    int8_t *q = r->q;
    float *scale = r->scale, *sum = r->sum;
    float buf[x_fp32 ? 1 : K];
    for (int64_t m = 0; m < rows; m++) {
        const float *xf = x_fp32 ? (const float *)x + m * K
                                 : as_f32((const uint16_t *)x + m * K, K, 0, buf);
        for (int64_t g = 0; g < G; g++) {
            const float *v = xf + g * Q4_GROUP;
            float amax = 0.0f;
#pragma omp simd reduction(max : amax)
            for (int i = 0; i < Q4_GROUP; i++) {
                float a = v[i] < 0 ? -v[i] : v[i];
                amax = a > amax ? a : amax;
            }
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int total = 0;
            int8_t *out = q + m * K + g * Q4_GROUP;
#pragma omp simd reduction(+ : total)
            for (int i = 0; i < Q4_GROUP; i++) {
                float s = v[i] * inv;
                int level = (int)(s + (s < 0 ? -0.5f : 0.5f));
                level = level > 127 ? 127 : (level < -127 ? -127 : level);
                out[i] = (int8_t)level;
                total += level;
            }
            scale[m * G + g] = amax / 127.0f;
            sum[m * G + g] = amax / 127.0f * (float)total;
        }
    }
}

/* --- the panel loops: acc[r][j] = y[m0 + r, 16p + j] before bias and residual ---------- */

static void panel_portable(const uint8_t *blocks, const Q4Rows *x, int64_t m0, int rows,
                           float acc[ROW_TILE][Q4_NR]) {
    memset(acc, 0, sizeof(float) * ROW_TILE * Q4_NR);
    for (int64_t g = 0; g < x->G; g++) {
        const uint8_t *b = blocks + g * Q4_BLOCK;
        const uint16_t *step = (const uint16_t *)(b + Q4_OCTETS * 64), *low = step + Q4_NR;
        for (int r = 0; r < rows; r++) {
            const int8_t *xq = x->q + (m0 + r) * x->K + g * Q4_GROUP;
            float xs = x->scale[(m0 + r) * x->G + g], xsum = x->sum[(m0 + r) * x->G + g];
            for (int j = 0; j < Q4_NR; j++) {
                int32_t dot = 0;
                for (int o = 0; o < Q4_OCTETS; o++) {
                    const uint8_t *lane = b + o * 64 + j * 4;
                    for (int i = 0; i < 4; i++) {
                        dot += (lane[i] & 15) * xq[o * 8 + i] + (lane[i] >> 4) * xq[o * 8 + 4 + i];
                    }
                }
                acc[r][j] += half_to_f32(step[j]) * (xs * (float)dot) + half_to_f32(low[j]) * xsum;
            }
        }
    }
}

/* NAME(...) calls ROWS_FN with a constant row count (1-4), so its accumulators stay in
 * registers. */
#define ROW_DISPATCH(NAME, ROWS_FN)                                                           \
    static void NAME(const uint8_t *blocks, const Q4Rows *x, int64_t m0, int rows,            \
                     float out[ROW_TILE][Q4_NR]) {                                            \
        switch (rows) {                                                                       \
        case 1: ROWS_FN(blocks, x, m0, 1, out); break;                                        \
        case 2: ROWS_FN(blocks, x, m0, 2, out); break;                                        \
        case 3: ROWS_FN(blocks, x, m0, 3, out); break;                                        \
        default: ROWS_FN(blocks, x, m0, 4, out); break;                                       \
        }                                                                                     \
    }

static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* 8 lanes (outputs) at a time: maddubs multiplies the u8 levels by the s8 activations into
 * 16-bit pairs (at most 2 x 15 x 127 = 3,810, so the 8 pairs a group adds stay in range),
 * widened to 32 bits once per 4 octets. */
static inline __attribute__((always_inline)) void panel_avx2_rows(
    const uint8_t *blocks, const Q4Rows *x, int64_t m0, const int rows,
    float out[ROW_TILE][Q4_NR]) {
    const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 accf[ROW_TILE][2];
    for (int r = 0; r < rows; r++) accf[r][0] = accf[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < x->G; g++) {
        const uint8_t *b = blocks + g * Q4_BLOCK;
        __builtin_prefetch(b + 4 * Q4_BLOCK);
        __builtin_prefetch(b + 4 * Q4_BLOCK + 64 * 4);
        __m256i acc[ROW_TILE][2];
        for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (int half = 0; half < 2; half++) {
            __m256i pairs[ROW_TILE][2];
            for (int r = 0; r < rows; r++) pairs[r][0] = pairs[r][1] = _mm256_setzero_si256();
            for (int o = 4 * half; o < 4 * half + 4; o++) {
                for (int side = 0; side < 2; side++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(b + o * 64 + side * 32));
                    __m256i lo = _mm256_and_si256(v, nib);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                    for (int r = 0; r < rows; r++) {
                        const int8_t *xq = x->q + (m0 + r) * x->K + g * Q4_GROUP + o * 8;
                        __m256i a = _mm256_set1_epi32(load_i32(xq));
                        __m256i c = _mm256_set1_epi32(load_i32(xq + 4));
                        pairs[r][side] = _mm256_add_epi16(
                            pairs[r][side], _mm256_add_epi16(_mm256_maddubs_epi16(lo, a),
                                                             _mm256_maddubs_epi16(hi, c)));
                    }
                }
            }
            for (int r = 0; r < rows; r++)
                for (int side = 0; side < 2; side++)
                    acc[r][side] = _mm256_add_epi32(acc[r][side],
                                                    _mm256_madd_epi16(pairs[r][side], ones));
        }
        const uint8_t *scales = b + Q4_OCTETS * 64;
        __m256 step[2], low[2];
        for (int side = 0; side < 2; side++) {
            step[side] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 16 * side)));
            low[side] =
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 32 + 16 * side)));
        }
        for (int r = 0; r < rows; r++) {
            __m256 xs = _mm256_set1_ps(x->scale[(m0 + r) * x->G + g]);
            __m256 xsum = _mm256_set1_ps(x->sum[(m0 + r) * x->G + g]);
            for (int side = 0; side < 2; side++) {
                __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][side]), xs);
                accf[r][side] = _mm256_fmadd_ps(step[side], t, accf[r][side]);
                accf[r][side] = _mm256_fmadd_ps(low[side], xsum, accf[r][side]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(out[r], accf[r][0]);
        _mm256_storeu_ps(out[r] + 8, accf[r][1]);
    }
}

ROW_DISPATCH(panel_avx2, panel_avx2_rows)
#define HAVE_AVX2_PATH 1
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* All 16 lanes in one register; vpdpbusd adds 4 u8 x s8 products per lane into 32 bits. */
static inline __attribute__((always_inline)) void panel_vnni_rows(
    const uint8_t *blocks, const Q4Rows *x, int64_t m0, const int rows,
    float out[ROW_TILE][Q4_NR]) {
    const __m512i nib = _mm512_set1_epi8(0x0f);
    __m512 accf[ROW_TILE];
    for (int r = 0; r < rows; r++) accf[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < x->G; g++) {
        const uint8_t *b = blocks + g * Q4_BLOCK;
        __builtin_prefetch(b + 4 * Q4_BLOCK);
        __builtin_prefetch(b + 4 * Q4_BLOCK + 64 * 4);
        __m512i acc[ROW_TILE];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_si512();
        for (int o = 0; o < Q4_OCTETS; o++) {
            __m512i v = _mm512_loadu_si512((const void *)(b + o * 64));
            __m512i lo = _mm512_and_si512(v, nib);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
            for (int r = 0; r < rows; r++) {
                const int8_t *xq = x->q + (m0 + r) * x->K + g * Q4_GROUP + o * 8;
                acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(load_i32(xq)));
                acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi32(load_i32(xq + 4)));
            }
        }
        const uint8_t *scales = b + Q4_OCTETS * 64;
        __m512 step = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
        __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 32)));
        for (int r = 0; r < rows; r++) {
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]),
                                     _mm512_set1_ps(x->scale[(m0 + r) * x->G + g]));
            accf[r] = _mm512_fmadd_ps(step, t, accf[r]);
            accf[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(x->sum[(m0 + r) * x->G + g]), accf[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out[r], accf[r]);
}

ROW_DISPATCH(panel_vnni, panel_vnni_rows)
#define HAVE_VNNI_PATH 1
#endif

typedef void (*PanelFn)(const uint8_t *, const Q4Rows *, int64_t, int, float[ROW_TILE][Q4_NR]);

/* Which loops: 0 the widest this CPU has, 1 AVX2's, 2 the portable ones (tests run each). */
static PanelFn q4_pick(int path) {
#if defined(HAVE_VNNI_PATH)
    if (path == 0) return panel_vnni;
#endif
#if defined(HAVE_AVX2_PATH)
    if (path <= 1) return panel_avx2;
#endif
    (void)path;
    return panel_portable;
}


/* y = x W^T (+ bias) (+ res) for the rounded rows x: y and res (nullable; it may be y
 * itself, added in place) fp32 when out_fp32, else bf16. Panels are split among threads. */
static void q4_project(const struct sb_q4 *w, const Q4Rows *x, int64_t rows, const void *res,
                       void *y, int out_fp32, PanelFn panel) {
    int64_t N = w->out_features, num_panels = (N + Q4_NR - 1) / Q4_NR;
#pragma omp parallel for schedule(static) if (num_panels > 1)
    for (int64_t p = 0; p < num_panels; p++) {
        const uint8_t *blocks = w->blocks + p * x->G * Q4_BLOCK;
        int64_t n0 = p * Q4_NR;
        int cols = N - n0 < Q4_NR ? (int)(N - n0) : Q4_NR;
        for (int64_t m0 = 0; m0 < rows; m0 += ROW_TILE) {
            int tile = rows - m0 < ROW_TILE ? (int)(rows - m0) : ROW_TILE;
            float acc[ROW_TILE][Q4_NR];
            panel(blocks, x, m0, tile, acc);
            for (int r = 0; r < tile; r++)
                pl_store_row(acc[r], cols, w->bias ? w->bias + n0 : NULL, res, y,
                             (m0 + r) * N + n0, out_fp32);
        }
    }
}

#endif /* SWITCHBOARD_Q4_H */
