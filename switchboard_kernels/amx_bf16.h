/* The bf16 panels of panels_bf16.h multiplied on AMX tiles (Intel Xeons since Sapphire
 * Rapids), for linear_bf16_cpu.c. Defines AMX_LINEAR where the compiler targets AMX-BF16.
 *
 * Why: with AVX512-BF16 a tile of 8 rows re-reads the panel from L1 for every 8 rows and
 * spends one VDPBF16PS per 16 outputs, 2 k and row; from 16 rows up it is compute-bound and
 * on a 2-core AMX Xeon a step's projections took 26 ms at 16 rows and 289 at 256 against
 * oneDNN's AMX 15 and 45 (bench.kernel_choices, docs/performance.md). oneDNN writes bf16
 * only, so the output layer, whose logits stay fp32, had no AMX path. One TDPBF16PS
 * multiplies 16 rows by 32 k into 16 x 16 fp32 sums (amx.h: the permission and the tiles).
 *
 * The panels need no other layout: a panel's half v (16 outputs) over 16 consecutive pairs
 * is a B tile in AMX's pair-interleaved (VNNI) form, rows 128 bytes apart. A tiles are 16
 * rows of x, 32 k each; x is copied to a zero-padded buffer when its rows are not a multiple
 * of 16. Tiles 0-3 hold the sums of a 32-row x 32-output block, 4-5 the rows, 6-7 the panel.
 * K must be a multiple of 32 (every hidden size served; others take the vector tiles).
 *
 * Sums: each output's fp32 sum runs over k in 32-wide steps, in the order TDPBF16PS adds
 * pairs, the same for every row and every row count that takes this path. It differs from
 * the vector tiles' order, so a batch-invariant projection (fixed_order) never comes here.
 */
#ifndef SWITCHBOARD_AMX_BF16_H
#define SWITCHBOARD_AMX_BF16_H

#include "amx.h"

#if defined(SB_AMX) && defined(TILE_ROWS)
#define AMX_LINEAR 1
#include <stdlib.h>

/* Rows [r0, r0 + rows) and the panel's columns [16v, 16v + 16) from a tile's sums in s,
 * bias and residual added, stored as the vector path stores them. */
static inline void amx_store(const float *s, int rows, int cols, const uint16_t *bias,
                             const void *res, void *y, int64_t ldy, int f32_out) {
    if (cols <= 0) return;
    __mmask16 m16 = tail_mask(cols);
    __m512 b = bias ? load_bf16(bias, m16) : _mm512_setzero_ps();
    for (int m = 0; m < rows; m++) {
        __m512 out = _mm512_add_ps(_mm512_load_ps(s + 16 * m), b);
        if (res && f32_out)
            out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(m16, (const float *)res + m * ldy));
        else if (res)
            out = _mm512_add_ps(out, load_bf16((const uint16_t *)res + m * ldy, m16));
        if (f32_out)
            _mm512_mask_storeu_ps((float *)y + m * ldy, m16, out);
        else
            store_bf16((uint16_t *)y + m * ldy, out, m16);
    }
}

/* Whether this call takes the tiles: rows enough, an order the caller may change, K whole
 * tiles, and the kernel allowed to use them. */
static inline int amx_fits(const struct sb_bf16_panels *w, int64_t rows, int64_t min_rows) {
    return rows >= min_rows && !w->fixed_order && w->in_features % AMX_K == 0 &&
           amx_permitted();
}

/* Panel p of w times x's rows (padded: a multiple of 16, zeros past rows) into y. */
static inline void amx_panel(const struct sb_bf16_panels *w, int64_t p, const uint16_t *x,
                             int64_t rows, int64_t padded, const void *res, void *y,
                             float sums[4][256]) {
    const int64_t K = w->in_features, N = w->out_features;
    const int f32_out = w->f32_out != 0;
    const size_t out_size = f32_out ? sizeof(float) : sizeof(uint16_t);
    const uint16_t *panel = w->panels + p * K * NP;
    const int64_t n0 = p * NP;
    const int cols = N - n0 < NP ? (int)(N - n0) : NP;
    for (int64_t m0 = 0; m0 < padded; m0 += 2 * AMX_ROWS) {
        const int two = padded - m0 > AMX_ROWS;
        const uint16_t *x0 = x + m0 * K, *x1 = x0 + AMX_ROWS * K;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += AMX_K) {
            /* pairs k/2 .. k/2 + 15 of half v start at bf16 (k/2 * 2 + v) * 16 * 2 */
            _tile_loadd(6, panel + k * 32, 128);
            _tile_loadd(7, panel + k * 32 + 32, 128);
            _tile_loadd(4, x0 + k, K * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, x1 + k, K * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        if (two) {
            _tile_stored(2, sums[2], 64);
            _tile_stored(3, sums[3], 64);
        }
        for (int t = 0; t < (two ? 4 : 2); t++) {
            const int64_t r0 = m0 + (t / 2) * AMX_ROWS, c0 = n0 + (t % 2) * 16;
            int rows_here = rows - r0 < AMX_ROWS ? (int)(rows - r0) : AMX_ROWS;
            int64_t at = r0 * N + c0;
            amx_store(sums[t], rows_here, cols - (t % 2) * 16, w->bias ? w->bias + c0 : NULL,
                      res ? (const char *)res + at * out_size : NULL, (char *)y + at * out_size,
                      N, f32_out);
        }
    }
}

/* From this many rows the panels are handed out one at a time as threads come free (the
 * two cores of a VM often run unevenly: a 1,024-token prefill step 320 -> 285 ms on the
 * AMX Xeon); fewer take static halves, whose hand-out costs less (decode steps). */
#define AMX_DYNAMIC_ROWS 128

/* y = x W^T (+ bias) (+ res) as sb_linear_bf16 computes it, on the tiles. */
static void amx_linear(const struct sb_bf16_panels *w, const uint16_t *x, int64_t rows,
                       const void *res, void *y) {
    const int64_t K = w->in_features, num_panels = (w->out_features + NP - 1) / NP;
    const int64_t padded = (rows + 15) / 16 * 16;
    uint16_t *copy = NULL;
    if (padded != rows) {
        copy = aligned_alloc(64, (size_t)(padded * K) * sizeof *copy);
        if (!copy) abort();
        memcpy(copy, x, (size_t)(rows * K) * sizeof *copy);
        memset(copy + rows * K, 0, (size_t)((padded - rows) * K) * sizeof *copy);
        x = copy;
    }
#pragma omp parallel
    {
        float sums[4][256] __attribute__((aligned(64)));
        amx_configure();
        if (padded >= AMX_DYNAMIC_ROWS) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t p = 0; p < num_panels; p++)
                amx_panel(w, p, x, rows, padded, res, y, sums);
        } else {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < num_panels; p++)
                amx_panel(w, p, x, rows, padded, res, y, sums);
        }
        _tile_release();
    }
    free(copy);
}
#endif

#endif /* SWITCHBOARD_AMX_BF16_H */
