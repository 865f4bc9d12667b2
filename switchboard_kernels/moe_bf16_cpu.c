/* A sparse MoE layer's grouped experts in bf16 (moe_steps.h) over each expert's bf16 panels
 * (panels_bf16.h, the layout of switchboard_kernels.linear_native.Bf16PanelLinear): the same
 * products, activation and roundings as the per-expert torch path over those panels. */
#include "panels_bf16.h"
#include "swiglu.h"

#if defined(TILE_ROWS)
#define MOE_T uint16_t
#define MOE_W struct sb_bf16_panels
#define MOE_NAME sb_moe_bf16

static inline int64_t moe_panels(const MOE_W *w) { return (w->out_features + NP - 1) / NP; }

static inline void moe_panel(const MOE_W *w, int64_t p, const uint16_t *x, int64_t rows,
                             uint16_t *y, const MOE_W *next, int64_t next_p) {
    (void)next, (void)next_p; /* the bf16 tiles stream without prefetch hints */
    bf16_panel(w, p, x, rows, NULL, y);
}

static inline void moe_silu_row(const uint16_t *gate, const uint16_t *up, uint16_t *y,
                                int64_t dim) {
    silu_mul_row_bf16(gate, up, y, dim, 0);
}

/* o = bf16(o + bf16(y * w)): torch's (y * w).to(bf16), then its bf16 index_add_. */
static inline void moe_add(uint16_t *o, uint16_t y, float w) {
    float scaled = bf16_to_f32(f32_to_bf16(bf16_to_f32(y) * w));
    *o = f32_to_bf16(bf16_to_f32(*o) + scaled);
}

#include "moe_steps.h"

int sb_moe_bf16_available(void) { return 1; }
#else /* no bf16 panels on this CPU: the torch path serves */
int sb_moe_bf16_available(void) { return 0; }
#endif
