/* Dense projections on CPU for fp32 activations: y = x W^T (+ bias) (+ residual), with W
 * packed once into panels of 16 output features, as fp32 or as int8 with a scale per output
 * feature (an approximate copy, for a draft model's passes).
 *
 * Why native code: on an AVX2-only CPU (AMD Zen 2/3), where the engine runs in fp32, oneDNN's
 * packed matmul reads a decode step's weights at about two thirds of the rate the cores can
 * stream (docs/performance.md), and its cost grows with every row added (a step of 5 rows
 * cost 30% more than one), although a few rows of arithmetic hide behind the bytes of a
 * memory-bound step. Here each panel of weights
 * is read from memory once for all rows (a step of up to ~16 rows stays about as dear as
 * one), and for larger batches the same micro-kernel runs from cache (BLIS's register-blocked
 * outer products, Van Zee and van de Geijn 2015). Speculative decoding verifies its drafts
 * in such rows, so their cost is what decides whether drafts pay.
 *
 * The panels' layout and the tiles are in panels_f32.h.
 */
#include "panels_f32.h"

/* y[m, n] = sum_k x[m, k] W[n, k] (* scales[n]) (+ bias[n]) (+ res[m, n]) for m < M. */
static void linear(const float *x, int64_t M, int64_t K, const void *panels, int is_int8,
                   const float *scales, int64_t N, const float *bias, const float *res,
                   int fixed_order, float *y) {
    int64_t num_panels = (N + NR - 1) / NR;
    int64_t panel_bytes = K * NR * (is_int8 ? 1 : 4), panel_lines = (panel_bytes + 63) / 64;
    /* guided, as the bf16 panels (linear_bf16_cpu.c): beside the spinner, 1 / 32 / 64 rows
     * 13.8 / 50.9 / 102.5 ms a step (median) against 13.8 / 57.0 / 105.4 static. */
#pragma omp parallel for schedule(guided)
    for (int64_t p = 0; p < num_panels; p++) {
        /* the next panel, fetched in shares by this panel's row groups */
        const char *next = (const char *)panels + (p + 1) * panel_bytes;
        f32_panel(x, M, K, panels, is_int8, scales, N, bias, res, fixed_order, y, p, next,
                  p + 1 < num_panels ? panel_lines : 0);
    }
}

/* Semantics: y = x W^T (+ bias) (+ res), x [rows, in], res (nullable) and y [rows, out],
 * all fp32 and contiguous. */
void sb_linear(const struct sb_panels *w, const float *x, int64_t rows, const float *res,
               float *y) {
    linear(x, rows, w->in_features, w->panels, w->scales != NULL, w->scales, w->out_features,
           w->bias, res, (int)w->fixed_order, y);
}
