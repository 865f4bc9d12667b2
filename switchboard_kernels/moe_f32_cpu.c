/* A sparse MoE layer's grouped experts in fp32 (moe_steps.h) over each expert's fp32 or int8
 * panels (panels_f32.h, the layout of switchboard_kernels.linear_native.PanelLinear). */
#include "panels_f32.h"
#include "swiglu.h"

#define MOE_T float
#define MOE_W struct sb_panels
#define MOE_NAME sb_moe_f32

static inline int64_t moe_panels(const MOE_W *w) { return (w->out_features + NR - 1) / NR; }

static inline int64_t panel_bytes(const MOE_W *w) {
    return w->in_features * NR * (w->scales ? 1 : 4);
}

/* Panel p of w for the rows, prefetching the panel that the thread multiplies next. */
static inline void moe_panel(const MOE_W *w, int64_t p, const float *x, int64_t rows, float *y,
                             const MOE_W *next, int64_t next_p) {
    const char *pf = (const char *)w->panels;
    int64_t lines = 0;
    if (next) {
        pf = (const char *)next->panels + next_p * panel_bytes(next);
        lines = (panel_bytes(next) + 63) / 64;
    }
    f32_panel(x, rows, w->in_features, w->panels, w->scales != NULL, w->scales, w->out_features,
              w->bias, NULL, (int)w->fixed_order, y, p, pf, lines);
}

static inline void moe_silu_row(const float *gate, const float *up, float *y, int64_t dim) {
    silu_mul_row_f32(gate, up, y, dim, 0);
}

static inline void moe_add(float *o, float y, float w) { *o += y * w; }

#include "moe_steps.h"

int sb_moe_f32_available(void) { return 1; }
