/* RoPE in place over a step's rows of q and k heads (rope.h: as the torch path computes it,
 * bit for bit).
 *
 * Why native code: torch spends four ops (a product, a roll, an addcmul, the copy out of the
 * fused qkv rows) and their temporaries on it, 7% of a 1,024-token prefill step on a 2-core
 * AMX Xeon (docs/performance.md); here each head is read and written once, in place.
 */
#include <stdint.h>

#include "rope.h"

/* Row r's heads [0, heads) of head_dim hd at x + r * row_stride (elements), rotated by
 * row positions[r] of the tables cos and signed_sin ([positions, hd], the rows' dtype). */
void sb_rope_rows(void *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t hd,
                  const void *cos, const void *signed_sin, const int64_t *positions, int fp32) {
#pragma omp parallel for schedule(static) if (rows * heads * hd > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t table = positions[r] * hd;
        if (fp32)
            rope_heads_f32((float *)x + r * row_stride, heads, hd, (const float *)cos + table,
                           (const float *)signed_sin + table);
        else
            rope_heads_bf16((uint16_t *)x + r * row_stride, heads, hd,
                            (const uint16_t *)cos + table, (const uint16_t *)signed_sin + table);
    }
}
