/* Dense projections in bf16 on x86 CPUs (AVX-512; AVX2 below): y = x W^T (+ bias)
 * (+ residual), with W packed once into panels of 32 output features whose weights pair
 * up along k.
 *
 * Why native code: a decode step of the default model in bf16 is its weights' bytes (212 MB
 * of projections a token), and oneDNN's packed matmul streams them at 16-19 GB/s for one
 * row on a 2-core Zen 4 that reads 31.7 GB/s; this kernel at 31 (docs/performance.md). With
 * AVX512-BF16, one VDPBF16PS multiplies 32 bf16 weights (16 outputs, two k each) by a row's
 * two activations and adds into fp32. Without it (e.g. a Xeon with AVX-512 but no BF16,
 * where oneDNN's bf16 matmul is emulated and slower than its fp32 one from 8 rows up), the
 * same pairs are widened to fp32 with a shift and a mask and go through two FMAs: the same
 * exact products (bf16 x bf16 fits fp32), the same fp32 sums. Either way each 64-byte line
 * of weights is loaded once and serves every row of the step; the panels a thread takes
 * come in long runs that lie one after another in memory, one stream for the hardware
 * prefetcher. Larger batches run the same tiles from cache, 8 rows at a time.
 *
 * The panels' layout and the tiles are in panels_bf16.h.
 */
#include "panels_bf16.h"
#include "amx_bf16.h"

#if defined(TILE_ROWS)
/* Semantics (every path): y = bf16(x W^T + bias + res), fp32 inside and one rounding;
 * x [rows, in], res (nullable) and y [rows, out], all bf16 and contiguous. With w->f32_out,
 * res and y are fp32 and the sum is stored unrounded (an output layer's logits; a projection
 * adding to a bf16 model's fp32 residual stream). */
void sb_linear_bf16(const struct sb_bf16_panels *w, const uint16_t *x, int64_t rows,
                    const void *res, void *y) {
#if defined(AMX_LINEAR)
    if (w->amx_rows > 0 && amx_fits(w, rows, w->amx_rows)) {
        amx_linear(w, x, rows, res, y);
        return;
    }
#endif
    const int64_t num_panels = (w->out_features + NP - 1) / NP;
    /* guided: a thread's panels still come in long runs (half, then a quarter, ...), and a
     * thread that a server's other threads or processes took its core from for a while no
     * longer holds its whole static half back from the region's end. `python -m bench.linear
     * --dtype bfloat16 --against <static build> --beside-spinner 0.0003` (Zen 4, median step):
     * 1 / 8 / 32 / 64 rows 6.8 / 9.2 / 24.8 / 46.2 ms against 6.7 / 9.4 / 25.1 / 46.8; alone
     * the same as static at each (8.7 / 9.1 / 22.3 / 41.4 against 8.7 / 9.3 / 22.6 / 41.5). */
#pragma omp parallel for schedule(guided)
    for (int64_t p = 0; p < num_panels; p++) bf16_panel(w, p, x, rows, res, y);
}

int sb_linear_bf16_available(void) { return 1; }

/* Whether calls of enough rows can take the AMX tiles: built for them, and the OS lends them. */
int sb_linear_bf16_amx(void) {
#if defined(AMX_LINEAR)
    return amx_permitted();
#else
    return 0;
#endif
}
#else /* neither: the Python side uses oneDNN */
int sb_linear_bf16_available(void) { return 0; }
int sb_linear_bf16_amx(void) { return 0; }
#endif
