/* Projections by 4-bit weights, for a draft model's small passes on CPU:
 * y = x W^T (+ bias) (+ residual), x bf16 or fp32 rows, W held as 4-bit levels.
 *
 * Why native code: a draft's one-token pass reads its weights from memory on every call
 * (the target's step, 269 MB for the default model, evicts them in between), so its cost
 * is its bytes, and 4 bits a weight is a quarter of bf16's. torch's CPU int4 kernel
 * (_weight_int4pack_mm_for_cpu) widens every weight to float before its FMAs: on a Zen 4 it
 * read an evicted weight at about a quarter of what one core streams, and on an AVX2-only
 * Zen 3 it ran far slower than fp32 (docs/performance.md). Here the activations are rounded
 * to int8 too (per row and group, as llama.cpp's Q4 x Q8 dot products do), so a group of 64
 * weights costs a few integer dot-product instructions (AVX-512 VNNI, or AVX2's maddubs) and
 * one float multiply-add per output: the loop keeps up with memory.
 *
 * Weights: per output n and group g of Q4_GROUP input features, 16 levels from the group's
 * minimum: W[n, k] ~ low[n, g] + q[n, k] * step[n, g], q in 0..15, low and step fp16.
 * Activations: x[m, k] ~ xq[m, k] * xs[m, g], xq in -127..127, xs = max |x| of the group
 * / 127. So y[m, n] = sum_g xs[m, g] (step[n, g] sum_k q xq + low[n, g] sum_k xq).
 *
 * Layout (switchboard_kernels/q4_native.py packs it): panels of Q4_NR outputs, each Q4_GROUP-feature
 * group of a panel one block of Q4_BLOCK bytes: 8 octets of 64 bytes, then 16 fp16 steps,
 * then 16 fp16 lows. In octet o (features k0 = 64g + 8o ...), output lane j has 4 bytes:
 * byte i = q[j, k0 + i] | q[j, k0 + 4 + i] << 4, so the low nibbles of a lane are 4
 * consecutive features, its high nibbles the next 4 (one 32-bit dot product each).
 */
#include "q4.h"

/* The loops this build has, as a bit mask: 1 VNNI, 2 AVX2, 4 portable. */
int sb_q4_paths(void) {
    int mask = 4;
#if defined(HAVE_VNNI_PATH)
    mask |= 1;
#endif
#if defined(HAVE_AVX2_PATH)
    mask |= 2;
#endif
    return mask;
}

/* Semantics: y = x W^T (+ bias) (+ res), W the 4-bit weight, x rounded to int8 levels as
 * above; x, res (nullable) and y [rows, in] / [rows, out], contiguous, fp32 when x_fp32
 * else bf16. Returns 0, or -1 if memory for the rounded rows ran out. */
int sb_q4_linear(const struct sb_q4 *w, const void *x, int x_fp32, int64_t rows,
                 const void *res, void *y, int path) {
    Q4Rows xr;
    if (q4_rows_alloc(&xr, rows, w->in_features)) return -1;
    q4_quantize_rows(x, x_fp32, rows, &xr);
    q4_project(w, &xr, rows, res, y, x_fp32, q4_pick(path));
    q4_rows_free(&xr);
    return 0;
}
