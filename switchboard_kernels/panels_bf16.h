/* The bf16 weight panels of linear_bf16_cpu.c and the tiles that multiply rows by them, shared
 * with the grouped experts of moe_bf16_cpu.c (each expert's projection is such a panel set).
 * Defines TILE_ROWS where the CPU has a path (AVX-512, or AVX2 with FMA), else nothing.
 *
 * Layout: panel p, pair j holds, for the outputs o = 32p + 16v + l (v = 0, 1; l < 16),
 * W[o, 2j] and W[o, 2j + 1] at bf16 offset ((p * K/2 + j) * 2 + v) * 32 + 2l (+ 1): one
 * vector of 16 pairs per v. K is even; the last panel is zero-padded.
 */
#ifndef SWITCHBOARD_PANELS_BF16_H
#define SWITCHBOARD_PANELS_BF16_H

#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define NP 32 /* outputs per panel */
#define MR 8  /* rows per tile: 16 accumulators, 2 weight vectors, 1 broadcast */

/* One projection, as switchboard_kernels/linear_native.py lays it out (its Bf16PanelLinear). */
struct sb_bf16_panels {
    int64_t in_features, out_features;
    const uint16_t *panels; /* see Layout above */
    const uint16_t *bias;   /* [out] bf16 or NULL */
    /* 1: a lone row sums in the order of a tile of many (batch-invariant); 0: two chains */
    int64_t fixed_order;
    /* 1: y is fp32, the sums stored unrounded (an output layer's logits); 0: y is bf16 */
    int64_t f32_out;
    /* calls of at least this many rows multiply on AMX tiles where built (amx_bf16.h); 0: never */
    int64_t amx_rows;
};

/* bf16.h's masked 16-bit loads and stores need AVX512-BW and -VL besides the foundation. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

#if defined(__AVX512BF16__)
typedef __m512bh wpairs; /* 16 lanes of (W[o, 2j], W[o, 2j + 1]) */
typedef __m512bh xpair;  /* (x[2j], x[2j + 1]) in every lane */

static inline xpair pair_of(const uint16_t *x) {
    int32_t both;
    memcpy(&both, x, sizeof both);
    return (__m512bh)_mm512_set1_epi32(both);
}

static inline wpairs weights(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }

static inline __m512 dot(__m512 acc, wpairs w, xpair x) { return _mm512_dpbf16_ps(acc, w, x); }

#else /* AVX-512 without BF16: each half of a pair widened to fp32 */
typedef struct {
    __m512 even, odd; /* W[o, 2j], W[o, 2j + 1] as fp32 */
} wpairs;
typedef struct {
    __m512 even, odd; /* x[2j], x[2j + 1] as fp32 in every lane */
} xpair;

static inline xpair pair_of(const uint16_t *x) {
    return (xpair){_mm512_set1_ps(bf16_to_f32(x[0])), _mm512_set1_ps(bf16_to_f32(x[1]))};
}

static inline wpairs weights(const uint16_t *p) {
    __m512i w = _mm512_loadu_si512(p);
    return (wpairs){_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)),
                    _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(~0xffff)))};
}

static inline __m512 dot(__m512 acc, wpairs w, xpair x) {
    return _mm512_fmadd_ps(w.odd, x.odd, _mm512_fmadd_ps(w.even, x.even, acc));
}
#endif

/* acc[m][v] = sum over pairs of x[m] . W for ROWS rows; ROWS is a constant at each call
 * site, so the accumulators live in registers. Each row's sums run over the pairs in order,
 * whatever the rows, except a lone row without fixed_order. */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t ldx,
                                                      const uint16_t *panel, int64_t pairs,
                                                      int64_t fixed_order, int rows,
                                                      __m512 acc[MR][2]) {
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    int64_t j = 0;
    if (rows == 1 && !fixed_order) {
        /* one row: two pairs at a time into two more sums, or each sum's chain of
         * dot products would bound the loop */
        __m512 odd0 = _mm512_setzero_ps(), odd1 = _mm512_setzero_ps();
        for (; j + 1 < pairs; j += 2) {
            const uint16_t *w = panel + j * 2 * NP;
            xpair x0 = pair_of(x + 2 * j), x1 = pair_of(x + 2 * j + 2);
            acc[0][0] = dot(acc[0][0], weights(w), x0);
            acc[0][1] = dot(acc[0][1], weights(w + NP), x0);
            odd0 = dot(odd0, weights(w + 2 * NP), x1);
            odd1 = dot(odd1, weights(w + 3 * NP), x1);
        }
        acc[0][0] = _mm512_add_ps(acc[0][0], odd0);
        acc[0][1] = _mm512_add_ps(acc[0][1], odd1);
    }
    for (; j < pairs; j++) {
        wpairs w0 = weights(panel + j * 2 * NP), w1 = weights(panel + j * 2 * NP + NP);
        for (int m = 0; m < rows; m++) {
            xpair xm = pair_of(x + m * ldx + 2 * j);
            acc[m][0] = dot(acc[m][0], w0, xm);
            acc[m][1] = dot(acc[m][1], w1, xm);
        }
    }
}

/* Columns [n0, n0 + cols) of rows [0, rows): acc + bias + residual, rounded once to bf16
 * (f32_out: the residual fp32 too, the sum stored as fp32, unrounded). */
static inline void store_tile(__m512 acc[MR][2], int rows, int cols, const uint16_t *bias,
                              const void *res, int64_t ldr, void *y, int64_t ldy,
                              int f32_out) {
    for (int v = 0; v < 2; v++) {
        int left = cols - 16 * v;
        if (left <= 0) break;
        __mmask16 m16 = tail_mask(left);
        __m512 b = bias ? load_bf16(bias + 16 * v, m16) : _mm512_setzero_ps();
        for (int m = 0; m < rows; m++) {
            __m512 out = _mm512_add_ps(acc[m][v], b);
            if (res && f32_out)
                out = _mm512_add_ps(
                    out, _mm512_maskz_loadu_ps(m16, (const float *)res + m * ldr + 16 * v));
            else if (res)
                out = _mm512_add_ps(out, load_bf16((const uint16_t *)res + m * ldr + 16 * v, m16));
            if (f32_out)
                _mm512_mask_storeu_ps((float *)y + m * ldy + 16 * v, m16, out);
            else
                store_bf16((uint16_t *)y + m * ldy + 16 * v, out, m16);
        }
    }
}

#define DISPATCH_ROWS(...)                                                                    \
    switch (rows) {                                                                           \
    case 1: tile(__VA_ARGS__, 1, acc); break;                                                  \
    case 2: tile(__VA_ARGS__, 2, acc); break;                                                  \
    case 3: tile(__VA_ARGS__, 3, acc); break;                                                  \
    case 4: tile(__VA_ARGS__, 4, acc); break;                                                  \
    case 5: tile(__VA_ARGS__, 5, acc); break;                                                  \
    case 6: tile(__VA_ARGS__, 6, acc); break;                                                  \
    case 7: tile(__VA_ARGS__, 7, acc); break;                                                  \
    default: tile(__VA_ARGS__, 8, acc); break;                                                 \
    }

#define TILE_ROWS MR

/* Rows [0, rows) (at most TILE_ROWS) of one panel: columns [0, cols) of y (bf16, or fp32
 * with f32_out, the residual then fp32 too). */
static inline void rows_of_panel(const uint16_t *x, int64_t K, const uint16_t *panel,
                                 int64_t pairs, int64_t fixed_order, int rows, int cols,
                                 const uint16_t *bias, const void *res, int64_t N, void *y,
                                 int f32_out) {
    __m512 acc[MR][2];
    DISPATCH_ROWS(x, K, panel, pairs, fixed_order)
    store_tile(acc, rows, cols, bias, res, N, y, N, f32_out);
}

#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 (AMD Zen 2/3, older Xeons): oneDNN has no bf16 matmul worth using there, and fp32
 * weights cost twice the bytes. The same panels, read 8 lanes at a time with GCC's vector
 * extensions: a quarter c of a panel's pair j is 16 bf16 at offset 16c, the pairs of
 * outputs 8c..8c+7, widened to fp32 as on AVX-512 without BF16 (two FMAs a pair). */
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

/* How far ahead the AVX2 tile asks for its weights: on a 2-core Zen 3 (2026-12-07) every
 * projection of the default model at 1 / 2 / 4 rows took 8.1 / 8.8 / 11.3 ms with the hardware
 * prefetcher alone, 7.5 / 7.4 / 9.8 asked 2 KB ahead (4 KB: 8.1 / 7.7 / 9.5); -D sets another. */
#ifndef AVX2_PREFETCH_BYTES
#define AVX2_PREFETCH_BYTES 2048
#endif
#define MR8 6 /* rows per tile: 24 accumulators, so some spill; a step of few rows is bytes */

static inline __attribute__((always_inline)) void tile8(const uint16_t *x, int64_t ldx,
                                                       const uint16_t *panel, int64_t pairs,
                                                       int rows, v8f acc[MR8][4]) {
    for (int m = 0; m < rows; m++)
        for (int c = 0; c < 4; c++) acc[m][c] = (v8f){0};
    for (int64_t j = 0; j < pairs; j++) {
        const uint16_t *w = panel + j * 2 * NP;
        if (AVX2_PREFETCH_BYTES) { /* a pair's two lines */
            __builtin_prefetch((const char *)w + AVX2_PREFETCH_BYTES);
            __builtin_prefetch((const char *)w + AVX2_PREFETCH_BYTES + 64);
        }
        float even_x[MR8], odd_x[MR8];
        for (int m = 0; m < rows; m++) {
            even_x[m] = bf16_to_f32(x[m * ldx + 2 * j]);
            odd_x[m] = bf16_to_f32(x[m * ldx + 2 * j + 1]);
        }
        for (int c = 0; c < 4; c++) {
            v8u both;
            memcpy(&both, w + 16 * c, sizeof both);
            v8f even = (v8f)(both << 16), odd = (v8f)(both & 0xffff0000u);
            for (int m = 0; m < rows; m++) acc[m][c] += even * even_x[m] + odd * odd_x[m];
        }
    }
}

static inline void rows_tile8(const uint16_t *x, int64_t K, const uint16_t *panel,
                              int64_t pairs, int rows, v8f acc[MR8][4]) {
    switch (rows) { /* a constant row count at each call: the accumulators in registers */
    case 1: tile8(x, K, panel, pairs, 1, acc); break;
    case 2: tile8(x, K, panel, pairs, 2, acc); break;
    case 3: tile8(x, K, panel, pairs, 3, acc); break;
    case 4: tile8(x, K, panel, pairs, 4, acc); break;
    case 5: tile8(x, K, panel, pairs, 5, acc); break;
    default: tile8(x, K, panel, pairs, 6, acc); break;
    }
}

#define TILE_ROWS MR8

static inline void rows_of_panel(const uint16_t *x, int64_t K, const uint16_t *panel,
                                 int64_t pairs, int64_t fixed_order, int rows, int cols,
                                 const uint16_t *bias, const void *res, int64_t N, void *y,
                                 int f32_out) {
    (void)fixed_order; /* every row sums in one order here */
    v8f acc[MR8][4];
    rows_tile8(x, K, panel, pairs, rows, acc);
    for (int m = 0; m < rows; m++) {
        float out[NP];
        memcpy(out, acc[m], sizeof out); /* quarter c holds outputs 8c..8c+7 */
        for (int o = 0; o < cols; o++) {
            float v = out[o];
            if (bias) v += bf16_to_f32(bias[o]);
            if (res && f32_out)
                v += ((const float *)res)[m * N + o];
            else if (res)
                v += bf16_to_f32(((const uint16_t *)res)[m * N + o]);
            if (f32_out)
                ((float *)y)[m * N + o] = v;
            else
                ((uint16_t *)y)[m * N + o] = f32_to_bf16(v);
        }
    }
}

#endif

#if defined(TILE_ROWS)
/* Rows [0, rows) of x times panel p of w: the columns [32p, 32p + 32) of y (and res, nullable),
 * whose rows are out_features long, rounded once to bf16 (w->f32_out: res and y fp32, the sum
 * unrounded). */
static inline void bf16_panel(const struct sb_bf16_panels *w, int64_t p, const uint16_t *x,
                              int64_t rows, const void *res, void *y) {
    const int64_t K = w->in_features, N = w->out_features, pairs = K / 2;
    const int64_t n0 = p * NP;
    const int cols = N - n0 < NP ? (int)(N - n0) : NP;
    const uint16_t *panel = w->panels + p * K * NP;
    const int f32_out = w->f32_out != 0;
    for (int64_t m0 = 0; m0 < rows; m0 += TILE_ROWS) {
        int rows_here = rows - m0 < TILE_ROWS ? (int)(rows - m0) : TILE_ROWS;
        int64_t at = m0 * N + n0; /* y's element offset */
        void *y_here = f32_out ? (void *)((float *)y + at) : (void *)((uint16_t *)y + at);
        const void *res_here = !res      ? NULL
                               : f32_out ? (const void *)((const float *)res + at)
                                         : (const void *)((const uint16_t *)res + at);
        rows_of_panel(x + m0 * K, K, panel, pairs, w->fixed_order, rows_here, cols,
                      w->bias ? w->bias + n0 : NULL, res_here, N, y_here, f32_out);
    }
}
#endif

#endif /* SWITCHBOARD_PANELS_BF16_H */
