/* Projections over a quantized base's weights on CPU: y = x W^T (+ bias) (+ residual), W held
 * as 4- or 8-bit levels with an fp32 scale and zero per output and group of input features
 * (switchboard_kernels/quantized_weight.py), x fp32 or bf16 rows, never rounded.
 *
 * Why native code: a decode step reads every weight once, so its cost is the weights' bytes;
 * 4-bit levels are a quarter of bf16's, 8-bit a half. The levels stream from memory in the
 * shared lane layout (panel_levels.h) and are widened to fp32 in registers; the activations
 * stay fp32 (a served base must be exact up to its weights' rounding, as transformers and PEFT
 * compute over a dequantized layer), so the products are fp32 FMAs, not integer dot products.
 *
 * Arithmetic: per output n and group g, w[n, k] = (q[n, k] - z[n, g]) s[n, g], so
 * y[m, n] = sum_g s[n, g] (sum_k q[n, k] x[m, k] - z[n, g] xsum[m, g]), xsum[m, g] the
 * group's sum of x; each inner sum in fp32 over the levels widened exactly, the group's
 * share added to an fp32 total. One shift, one mask and one conversion give a feature's 16
 * levels (AVX2: one mask, panel_avx2_rows); one FMA per row uses them, so rows of a step share
 * the unpacking.
 *
 * Layout (wq_native.py packs it): panels of PL_NR outputs, each group one block: the levels
 * (group * PL_NR * bits / 8 bytes), then PL_NR scales, then PL_NR zeros, fp32, or fp16 where
 * every scale and zero is one exactly (`half_params`; a GPTQ or AWQ checkpoint's, and the
 * on-load quantizer's): a 4-bit group of 32 is then 320 bytes instead of 384.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "panel_levels.h"

#define WQ_ROWS 8 /* rows sharing each unpacked vector of levels */
/* How far ahead of its loads each loop asks for its levels, scales and zeros (every 64-byte
 * step, and each group's scales and zeros). On a 2-core Zen 3 (AVX2) a step's projections at
 * one row took 4.7 ms asked 4 KB ahead, 5.4 asked 512 bytes ahead (1-8 KB alike; a line a
 * group ahead: 6.8). On a 2-core Zen 4 (the AVX512-BF16 loop) batch-1 decode of the default
 * model in int4 went from 143 to 162 tok/s (with an int4 output layer 169 to 195), 2 and 8 KB
 * within noise of 4. -D sets another. */
#ifndef WQ_PREFETCH_BYTES
#define WQ_PREFETCH_BYTES 4096
#endif

struct sb_wq {
    int64_t in_features, out_features, group_size, bits;
    const uint8_t *blocks; /* [ceil(out / 16)][in / group][block bytes] */
    const float *bias;     /* [out] or NULL */
    int64_t half_params;   /* scales and zeros stored fp16, else fp32 */
};

/* Each group's sum of a row (one order, whichever loop then takes the row). */
static void group_sums(const float *row, int64_t G, int64_t gs, float *out) {
    for (int64_t g = 0; g < G; g++) {
        const float *v = row + g * gs;
        float t = 0.0f;
#pragma omp simd reduction(+ : t)
        for (int64_t i = 0; i < gs; i++) t += v[i];
        out[g] = t;
    }
}

/* The step's rows as the loops read them: fp32, and each group's sum. */
typedef struct {
    const float *x;     /* [rows, K] */
    float *xsum;        /* [rows, G] */
    int64_t K, G;
    const void *prepared; /* the rows as the loop takes them: the bf16 loop's pairs
                            (bf16_pairs), the AVX2 loop's scaled fp32 (scaled_rows) */
} WqRows;

static int64_t level_bytes(const struct sb_wq *w) { return w->group_size * PL_NR * w->bits / 8; }
static int64_t block_bytes(const struct sb_wq *w) {
    return level_bytes(w) + 2 * PL_NR * (w->half_params ? 2 : 4);
}

/* A group's scales and zeros (at p, after its levels) as fp32. */
static void group_params(const struct sb_wq *w, const uint8_t *p, float s[PL_NR],
                         float z[PL_NR]) {
    if (!w->half_params) {
        memcpy(s, p, sizeof(float) * PL_NR);
        memcpy(z, p + sizeof(float) * PL_NR, sizeof(float) * PL_NR);
        return;
    }
    for (int j = 0; j < PL_NR; j++) {
        uint16_t hs, hz;
        memcpy(&hs, p + 2 * j, 2), memcpy(&hz, p + 2 * (PL_NR + j), 2);
        s[j] = half_to_f32(hs), z[j] = half_to_f32(hz);
    }
}

/* --- the panel loops: out[r][j] = y[m0 + r, 16p + j] before bias and residual ------------ */

typedef void (*WqPanel)(const struct sb_wq *, const uint8_t *, const WqRows *, int64_t, int,
                        float[WQ_ROWS][PL_NR]);

static void panel_portable(const struct sb_wq *w, const uint8_t *panel, const WqRows *x,
                           int64_t m0, int rows, float out[WQ_ROWS][PL_NR]) {
    const int64_t gs = w->group_size, lb = level_bytes(w), bb = block_bytes(w);
    const int per_step = PL_STEP_FEATURES(w->bits);
    memset(out, 0, sizeof(float) * WQ_ROWS * PL_NR);
    for (int64_t g = 0; g < x->G; g++) {
        const uint8_t *b = panel + g * bb;
        float s[PL_NR], z[PL_NR];
        group_params(w, b + lb, s, z);
        for (int r = 0; r < rows; r++) {
            const float *xg = x->x + (m0 + r) * x->K + g * gs;
            float xs = x->xsum[(m0 + r) * x->G + g];
            for (int j = 0; j < PL_NR; j++) {
                float part = 0.0f;
                for (int64_t o = 0; o < gs / per_step; o++) {
                    const uint8_t *lane = b + o * PL_STEP_BYTES + j * 4;
                    const float *xk = xg + o * per_step;
                    for (int i = 0; i < 4; i++) {
                        if (w->bits == 4) {
                            part += (float)(lane[i] & 15) * xk[i];
                            part += (float)(lane[i] >> 4) * xk[4 + i];
                        } else {
                            part += (float)lane[i] * xk[i];
                        }
                    }
                }
                out[r][j] += s[j] * (part - z[j] * xs);
            }
        }
    }
}

/* NAME(...) calls ROWS_FN with constant bits and row count (1 .. 8, at most the loop's tile),
 * so the row loops unroll and the accumulators stay in registers. */
#define WQ_CASES(ROWS_FN, BITS)                                                               \
    switch (rows) {                                                                           \
    case 1: ROWS_FN(w, panel, x, m0, BITS, 1, out); break;                                    \
    case 2: ROWS_FN(w, panel, x, m0, BITS, 2, out); break;                                    \
    case 3: ROWS_FN(w, panel, x, m0, BITS, 3, out); break;                                    \
    case 4: ROWS_FN(w, panel, x, m0, BITS, 4, out); break;                                    \
    case 5: ROWS_FN(w, panel, x, m0, BITS, 5, out); break;                                    \
    case 6: ROWS_FN(w, panel, x, m0, BITS, 6, out); break;                                    \
    case 7: ROWS_FN(w, panel, x, m0, BITS, 7, out); break;                                    \
    default: ROWS_FN(w, panel, x, m0, BITS, 8, out); break;                                   \
    }
#define WQ_DISPATCH(NAME, ROWS_FN)                                                            \
    static void NAME(const struct sb_wq *w, const uint8_t *panel, const WqRows *x, int64_t m0, \
                     int rows, float out[WQ_ROWS][PL_NR]) {                                   \
        if (w->bits == 4) {                                                                   \
            WQ_CASES(ROWS_FN, 4)                                                              \
        } else {                                                                              \
            WQ_CASES(ROWS_FN, 8)                                                              \
        }                                                                                     \
    }

#if defined(__AVX512F__)
/* group_params for 16 lanes: fp16 widened exactly (VCVTPH2PS). */
static inline __m512 params512(const uint8_t *p, int half, int zeros) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * PL_NR * zeros)))
                : _mm512_loadu_ps((const float *)p + PL_NR * zeros);
}

static inline __attribute__((always_inline)) void panel_avx512_rows(
    const struct sb_wq *w, const uint8_t *panel, const WqRows *x, int64_t m0, const int bits,
    const int R, float out[WQ_ROWS][PL_NR]) {
    const int64_t gs = w->group_size, lb = level_bytes(w), bb = block_bytes(w);
    const int half = (int)w->half_params, per_step = bits == 4 ? 8 : 4;
    const int C = R >= 4 ? 1 : (R == 1 ? 4 : 2); /* FMA chains per row */
    const __m512i mask = _mm512_set1_epi32(bits == 4 ? 0x0f : 0xff);
    __m512 acc[WQ_ROWS];
    const float *xr[WQ_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), xr[r] = x->x + (m0 + r) * x->K;
    for (int64_t g = 0; g < x->G; g++) {
        const uint8_t *b = panel + g * bb;
        __m512 part[WQ_ROWS][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) part[r][c] = _mm512_setzero_ps();
        for (int64_t o = 0; o < gs / per_step; o++) {
            __builtin_prefetch(b + o * PL_STEP_BYTES + WQ_PREFETCH_BYTES);
            __m512i v = _mm512_loadu_si512((const void *)(b + o * PL_STEP_BYTES));
            const int64_t k0 = g * gs + o * per_step;
            for (int i = 0; i < 4; i++) {
                __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * i), mask));
                for (int r = 0; r < R; r++)
                    part[r][i % C] =
                        _mm512_fmadd_ps(lo, _mm512_set1_ps(xr[r][k0 + i]), part[r][i % C]);
                if (bits == 4) {
                    __m512 hi = _mm512_cvtepi32_ps(
                        _mm512_and_si512(_mm512_srli_epi32(v, 8 * i + 4), mask));
                    for (int r = 0; r < R; r++)
                        part[r][(i + 1) % C] = _mm512_fmadd_ps(
                            hi, _mm512_set1_ps(xr[r][k0 + 4 + i]), part[r][(i + 1) % C]);
                }
            }
        }
        __builtin_prefetch(b + lb + WQ_PREFETCH_BYTES);
        __builtin_prefetch(b + lb + 64 + WQ_PREFETCH_BYTES);
        __m512 s = params512(b + lb, half, 0), z = params512(b + lb, half, 1);
        for (int r = 0; r < R; r++) {
            __m512 sum = part[r][0];
            for (int c = 1; c < C; c++) sum = _mm512_add_ps(sum, part[r][c]);
            sum = _mm512_fnmadd_ps(z, _mm512_set1_ps(x->xsum[(m0 + r) * x->G + g]), sum);
            acc[r] = _mm512_fmadd_ps(s, sum, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
}

WQ_DISPATCH(panel_avx512, panel_avx512_rows)
#define HAVE_AVX512_PATH 1
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* bf16 rows times 4- or 8-bit levels: one VDPBF16PS multiplies 16 outputs' pairs of 4-bit
 * values by a pair of the row's activations, exactly (such a value as bf16 is exact), adding
 * into fp32. A lane's pairs come out of its 32 bits with a shift and one ternary-logic op:
 * masked to a nibble in each 16-bit half and ORed with bf16 128.0's bits, each half is the bf16
 * 128 + nibble. 4-bit: the nibbles are the levels; the halves pair features (k0, k0 + 2),
 * (k0 + 1, k0 + 3), (k0 + 4, k0 + 6), (k0 + 5, k0 + 7), and the group's zero is taken as
 * z + 128. 8-bit: a level is lo + 16 hi, its two nibbles; the halves pair (k0, k0 + 2) and
 * (k0 + 1, k0 + 3), low nibbles into one sum and high ones into another, which counts 16
 * times, and the zero is taken as z + 128 + 16 * 128. The rows are permuted into those pairs
 * once a call (bf16_pairs). */
/* Pair t of each lane of a 64-byte step of levels, as above: the nibbles at offsets 0, 8, 4,
 * 12 (t = 0 .. 3) of each 16-bit half, ORed with bf16 128.0's bits. 4-bit: feature pairs t;
 * 8-bit: t = 0, 1 the low nibbles of pairs 0 and 1, t = 2, 3 their high nibbles. */
static inline __m512i level_pairs_bf16(__m512i v, int t) {
    static const int shift[4] = {0, 8, 4, 12};
    return _mm512_ternarylogic_epi32(_mm512_srli_epi32(v, shift[t]),
                                     _mm512_set1_epi32(0x000f000f),
                                     _mm512_set1_epi32(0x43004300), 0xEA); /* (a & b) | c */
}

static inline __attribute__((always_inline)) void panel_bf16_rows(
    const struct sb_wq *w, const uint8_t *panel, const WqRows *x, int64_t m0, const int bits,
    const int R, float out[WQ_ROWS][PL_NR]) {
    const int64_t gs = w->group_size, lb = level_bytes(w), bb = block_bytes(w);
    const int half = (int)w->half_params, per_step = bits == 4 ? 8 : 4;
    /* independent dot-product chains per row (8-bit: each of its two sums) */
    const int C = bits == 8 ? (R == 1 ? 2 : 1) : (R >= 4 ? 1 : (R == 1 ? 4 : 2));
    const uint16_t *xp = (const uint16_t *)x->prepared;
    __m512 acc[WQ_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < x->G; g++) {
        const uint8_t *b = panel + g * bb;
        __m512 part[WQ_ROWS][4], high[WQ_ROWS][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) part[r][c] = high[r][c] = _mm512_setzero_ps();
        for (int64_t o = 0; o < gs / per_step; o++) {
            __builtin_prefetch(b + o * PL_STEP_BYTES + WQ_PREFETCH_BYTES);
            __m512i v = _mm512_loadu_si512((const void *)(b + o * PL_STEP_BYTES));
            const int64_t k0 = g * gs + o * per_step;
            for (int t = 0; t < 4; t++) {
                __m512i q = level_pairs_bf16(v, t);
                const int pair = bits == 4 ? t : (t & 1);
                for (int r = 0; r < R; r++) {
                    int32_t xv;
                    memcpy(&xv, xp + (m0 + r) * x->K + k0 + 2 * pair, sizeof xv);
                    __m512bh xb = (__m512bh)_mm512_set1_epi32(xv);
                    if (bits == 8 && t >= 2)
                        high[r][t % C] = _mm512_dpbf16_ps(high[r][t % C], (__m512bh)q, xb);
                    else
                        part[r][t % C] = _mm512_dpbf16_ps(part[r][t % C], (__m512bh)q, xb);
                }
            }
        }
        __builtin_prefetch(b + lb + WQ_PREFETCH_BYTES);
        __builtin_prefetch(b + lb + 64 + WQ_PREFETCH_BYTES);
        __m512 s = params512(b + lb, half, 0);
        __m512 z = _mm512_add_ps(params512(b + lb, half, 1),
                                 _mm512_set1_ps(bits == 4 ? 128.0f : 128.0f * 17.0f));
        for (int r = 0; r < R; r++) {
            __m512 sum = part[r][0];
            for (int c = 1; c < C; c++) sum = _mm512_add_ps(sum, part[r][c]);
            if (bits == 8) {
                __m512 hi = high[r][0];
                for (int c = 1; c < C; c++) hi = _mm512_add_ps(hi, high[r][c]);
                sum = _mm512_fmadd_ps(_mm512_set1_ps(16.0f), hi, sum);
            }
            sum = _mm512_fnmadd_ps(z, _mm512_set1_ps(x->xsum[(m0 + r) * x->G + g]), sum);
            acc[r] = _mm512_fmadd_ps(s, sum, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
}

WQ_DISPATCH(panel_bf16, panel_bf16_rows)
#define HAVE_BF16_PATH 1

/* Calls of many bf16 rows (a batch's decode step, a prompt): each pair of panels is unpacked
 * once a call into bf16 pairs of levels (unpack_panels), which every tile of rows then
 * multiplies as the bf16 panels' tiles multiply bf16 weights (panels_bf16.h): one load a
 * vector of pairs, one VDPBF16PS a row. panel_bf16 unpacks a step's levels again for each tile
 * of 8 rows (two ops a vector of pairs beside 8 VDPBF16PS), and splits an 8-bit level into its
 * two nibbles, two VDPBF16PS a pair of features. Here the levels and their pairs are as
 * panel_bf16 takes them, 4-bit as bf16 128 + q (the zero offset by 128), 8-bit as q itself
 * (at most 255, exact in bf16); each row's sums run in panel_bf16's order at 4 rows and more,
 * so 4-bit products carry its bits. On a 2-core Zen 4 every projection of the default model at
 * 32 rows took 22.4 ms in 4-bit (24.9 with the panels' levels unpacked per tile, two panels
 * at a time), 19.8 in 8-bit per channel (33.9), bf16 16.0-16.3; at 128 rows in 4-bit 77.9
 * (92.8), bf16 61.1. The rest of the 4-bit gap: each group's scale and zero (two FMAs a row
 * beside 16 VDPBF16PS at groups of 32) and the unpacking's stores. */
static void bf16_pairs(const uint16_t *x, int64_t rows, int64_t K, int bits, uint16_t *out);

#define UNPACKED_TILE 8 /* rows: 8 x 2 panels' group sums in 16 registers */
/* The fewest rows that take the unpacked levels (4-bit, 8-bit): measured on that Zen 4, 4-bit
 * even with panel_bf16 at 16 rows and ahead from 24, 8-bit ahead from 8; the other
 * AVX512-BF16 CPUs (Zen 5, Xeons with AMX) take them untried. -D sets others. */
#ifndef UNPACKED_MIN_ROWS4
#define UNPACKED_MIN_ROWS4 16
#endif
#ifndef UNPACKED_MIN_ROWS8
#define UNPACKED_MIN_ROWS8 8
#endif

/* The next pair of panels' packed bytes, asked for while a tile multiplies the pair before
 * (per_group bytes at each group of each tile), so that unpacking them does not wait on memory
 * with nothing to multiply. On a 2-core Zen 4 a step's projections (the bf16 output layer
 * included) at 32 rows took 25.9 instead of 28.4 ms, at 128 rows 94.0 instead of 96.0 (into
 * L1 instead of L2: the same). Tried and not kept: each thread unpacking its next pair inside
 * its first tile's loop, beside the products, into a second buffer: 8-bit 9.9 instead of
 * 10.9 ms at 8 rows and 13.7 instead of 15.0 at 16, but no faster at 32 and 8% slower at 128
 * (that tile ran slower than the unpacking it took on), and 4-bit slower at every count (its
 * unpacking cut into per-step calls for it). */
typedef struct {
    const uint8_t *at;
    int64_t per_group;
} Ahead;
#ifndef WQ_AHEAD_LOCALITY
#define WQ_AHEAD_LOCALITY 2
#endif

/* One group of a pair of panels unpacked: its gs / 2 pairs of features, two vectors of 16
 * lanes each (unpacked_pair_bytes), then each panel's 16 scales and 16 zeros (with
 * panel_bf16's offset), fp32. */
static int64_t unpacked_pair_bytes(int64_t gs) { return gs / 2 * 2 * 64; }
static int64_t unpacked_group_bytes(int64_t gs) { return unpacked_pair_bytes(gs) + 2 * 2 * 64; }

/* Panels p and p + 1 (two: 0 where p is the last; its half is zeros) into `to`. */
static void unpack_panels(const struct sb_wq *w, const uint8_t *panel, int64_t panel_bytes,
                          int two, uint8_t *to) {
    const int64_t gs = w->group_size, lb = level_bytes(w), bb = block_bytes(w);
    const int64_t G = w->in_features / gs, per_step = PL_STEP_FEATURES(w->bits);
    const int half = (int)w->half_params, bits = (int)w->bits;
    const int64_t group_bytes = unpacked_group_bytes(gs);
    const __m512i bytes = _mm512_set1_epi32(0x00ff00ff), low = _mm512_set1_epi32(0xffff);
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t g = 0; g < G; g++) {
        uint32_t *pairs = (uint32_t *)(to + g * group_bytes);
        float *params = (float *)(to + g * group_bytes + unpacked_pair_bytes(gs));
        for (int h = 0; h < 2; h++) {
            if (h == 1 && !two) {
                for (int64_t j = 0; j < gs / 2; j++)
                    _mm512_storeu_si512(pairs + (2 * j + 1) * 16, _mm512_setzero_si512());
                _mm512_storeu_ps(params + 32 * h, _mm512_setzero_ps());
                _mm512_storeu_ps(params + 32 * h + 16, _mm512_setzero_ps());
                continue;
            }
            const uint8_t *b = panel + h * panel_bytes + g * bb;
            for (int64_t o = 0; o < gs / per_step; o++) {
                __m512i v = _mm512_loadu_si512((const void *)(b + o * PL_STEP_BYTES));
                if (bits == 4) {
                    for (int t = 0; t < 4; t++)
                        _mm512_storeu_si512(pairs + (2 * (4 * o + t) + h) * 16,
                                            level_pairs_bf16(v, t));
                    continue;
                }
                for (int t = 0; t < 2; t++) { /* bytes (0, 2) and (1, 3): pairs (k0, k0 + 2) */
                    __m512i q = _mm512_and_si512(_mm512_srli_epi32(v, 8 * t), bytes);
                    __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, low));
                    __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 16));
                    __m512i as_pairs = _mm512_or_si512(
                        _mm512_and_si512(_mm512_castps_si512(hi), high),
                        _mm512_srli_epi32(_mm512_castps_si512(lo), 16));
                    _mm512_storeu_si512(pairs + (2 * (2 * o + t) + h) * 16, as_pairs);
                }
            }
            _mm512_storeu_ps(params + 32 * h, params512(b + lb, half, 0));
            _mm512_storeu_ps(params + 32 * h + 16,
                             _mm512_add_ps(params512(b + lb, half, 1),
                                           _mm512_set1_ps(bits == 4 ? 128.0f : 0.0f)));
        }
    }
}

/* out[h][r] = rows m0 .. m0 + R of a pair of panels unpacked at `from`. Each row's group
 * sums in registers (2R chains of VDPBF16PS, as the bf16 panels' tiles keep), its running
 * totals in `out` between groups. */
static inline __attribute__((always_inline)) void unpacked_rows(const struct sb_wq *w,
                                                               const uint8_t *from,
                                                               const WqRows *x, int64_t m0,
                                                               const int R,
                                                               float out[2][WQ_ROWS][PL_NR],
                                                               const Ahead *ahead) {
    const int64_t gs = w->group_size, group_bytes = unpacked_group_bytes(gs);
    const uint16_t *xp = (const uint16_t *)x->prepared;
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < R; r++) _mm512_storeu_ps(out[h][r], _mm512_setzero_ps());
    for (int64_t g = 0; g < x->G; g++) {
        const uint32_t *pairs = (const uint32_t *)(from + g * group_bytes);
        const float *params = (const float *)(from + g * group_bytes + unpacked_pair_bytes(gs));
        __m512 part[WQ_ROWS][2];
        for (int r = 0; r < R; r++) part[r][0] = part[r][1] = _mm512_setzero_ps();
        for (int64_t i = 0; i < ahead->per_group; i += 64)
            __builtin_prefetch(ahead->at + g * ahead->per_group + i, 0, WQ_AHEAD_LOCALITY);
        for (int64_t j = 0; j < gs / 2; j++) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(pairs + 32 * j);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(pairs + 32 * j + 16);
            for (int r = 0; r < R; r++) {
                int32_t xv;
                memcpy(&xv, xp + (m0 + r) * x->K + g * gs + 2 * j, sizeof xv);
                __m512bh xb = (__m512bh)_mm512_set1_epi32(xv);
                part[r][0] = _mm512_dpbf16_ps(part[r][0], w0, xb);
                part[r][1] = _mm512_dpbf16_ps(part[r][1], w1, xb);
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m512 s = _mm512_loadu_ps(params + 32 * h);
            const __m512 z = _mm512_loadu_ps(params + 32 * h + 16);
            for (int r = 0; r < R; r++) {
                __m512 sum = _mm512_fnmadd_ps(z, _mm512_set1_ps(x->xsum[(m0 + r) * x->G + g]),
                                              part[r][h]);
                _mm512_storeu_ps(out[h][r], _mm512_fmadd_ps(s, sum, _mm512_loadu_ps(out[h][r])));
            }
        }
    }
}

/* WQ_CASES's row counts (its bits unused): `panel` is the pair of panels unpacked. */
#define unpacked_rows_of(w, panel, x, m0, BITS, R, out)                                       \
    unpacked_rows(w, panel, x, m0, R, out, ahead)
static void unpacked_tile(const struct sb_wq *w, const uint8_t *panel, const WqRows *x,
                          int64_t m0, int rows, float out[2][WQ_ROWS][PL_NR],
                          const Ahead *ahead) {
    WQ_CASES(unpacked_rows_of, 0)
}

/* y = x W^T (+ bias) (+ res) for bf16 rows x through pairs of panels unpacked once each; the
 * rows' pairs and group sums prepared in the same parallel region. -1 if memory ran out. */
static int unpacked_linear(const struct sb_wq *w, const uint16_t *x, int64_t rows,
                           const void *res, void *y, int out_fp32) {
    const int64_t K = w->in_features, N = w->out_features, G = K / w->group_size;
    const int64_t num_panels = (N + PL_NR - 1) / PL_NR;
    const int64_t panel_bytes = G * block_bytes(w), items = (num_panels + 1) / 2;
    /* tiles of at most UNPACKED_TILE rows, as even as the count allows (no short last one) */
    const int64_t tiles = (rows + UNPACKED_TILE - 1) / UNPACKED_TILE;
    const int64_t base = rows / tiles, longer = rows % tiles;
    uint16_t *pairs = malloc(sizeof(uint16_t) * (size_t)(rows * K));
    float *xsum = malloc(sizeof(float) * (size_t)(rows * G));
    int failed = !pairs || !xsum;
    if (failed) {
        free(pairs), free(xsum);
        return -1;
    }
    const WqRows xr = {NULL, xsum, K, G, pairs};
#pragma omp parallel reduction(| : failed)
    {
        uint8_t *buffer = aligned_alloc(64, (size_t)(G * unpacked_group_bytes(w->group_size)));
        float *wide = malloc(sizeof(float) * (size_t)K);
        if (!buffer || !wide) failed = 1;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++) {
            if (!wide) continue;
            bf16_pairs(x + m * K, 1, K, (int)w->bits, pairs + m * K);
            as_f32(x + m * K, K, 0, wide);
            group_sums(wide, G, w->group_size, xsum + m * G);
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (!buffer) continue;
            const int64_t p0 = 2 * item;
            const int two = p0 + 1 < num_panels;
            unpack_panels(w, w->blocks + p0 * panel_bytes, panel_bytes, two, buffer);
            /* the next pair's bytes (none after the last), a share at each tile's groups */
            const int64_t next = p0 + 2 < num_panels ? (num_panels - p0 - 2 > 1 ? 2 : 1) : 0;
            const int64_t share = (next * panel_bytes + 64 * tiles * G - 1) / (64 * tiles * G) * 64;
            const uint8_t *next_bytes = next ? w->blocks + (p0 + 2) * panel_bytes : w->blocks;
            for (int64_t tile = 0, m0 = 0; tile < tiles; tile++) {
                const int t = (int)(base + (tile < longer));
                const Ahead ahead = {next_bytes + tile * G * share, share};
                float acc[2][WQ_ROWS][PL_NR];
                unpacked_tile(w, buffer, &xr, m0, t, acc, &ahead);
                for (int h = 0; h < 1 + two; h++) {
                    const int64_t n0 = (p0 + h) * PL_NR;
                    const int cols = N - n0 < PL_NR ? (int)(N - n0) : PL_NR;
                    for (int r = 0; r < t; r++)
                        pl_store_row(acc[h][r], cols, w->bias ? w->bias + n0 : NULL, res, y,
                                     (m0 + r) * N + n0, out_fp32);
                }
                m0 += t;
            }
        }
        free(buffer), free(wide);
    }
    free(pairs), free(xsum);
    return failed ? -1 : 0;
}
#endif

/* The bf16 rows [rows, K] with each step's features in the order the level pairs take them
 * (4-bit: 8 features a step, 8-bit: 4). */
static void bf16_pairs(const uint16_t *x, int64_t rows, int64_t K, int bits, uint16_t *out) {
    static const int order4[8] = {0, 2, 1, 3, 4, 6, 5, 7}, order8[4] = {0, 2, 1, 3};
    const int n = bits == 4 ? 8 : 4;
    const int *order = bits == 4 ? order4 : order8;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t k = 0; k < K; k += n)
            for (int i = 0; i < n; i++) out[m * K + k + i] = x[m * K + k + order[i]];
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* group_params for 8 lanes, half h of the panel's 16. */
static inline __m256 params256(const uint8_t *p, int half, int zeros, int h) {
    const int64_t at = PL_NR * zeros + 8 * h; /* the first lane's place, in values */
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * at)))
                : _mm256_loadu_ps((const float *)p + at);
}

/* The AVX2 loop takes each level out of its lane with one AND, in place: masked at bit offset
 * b, the lane is the level times 2^b, which converts to fp32 exactly (at most 8 significant
 * bits), so the row's activation for that feature comes pre-scaled by 2^-b (scaled_rows; a
 * power of two, exact above fp32's subnormals) and the product is the level times the
 * activation as before, with no shift per level. The top nibble or byte would set the sign
 * bit, so it is shifted down once first. Offsets per feature of a step (4-bit: byte i holds
 * features i and 4 + i in its low and high nibbles). */
static const int avx2_offset4[8] = {0, 8, 16, 24, 4, 12, 20, 24}; /* feature 7: (v >> 4) */
static const int avx2_offset8[4] = {0, 8, 16, 16};                /* feature 3: (v >> 8) */

/* x [rows, K] times 2^-offset of each feature's place in its step (the AVX2 loop's rows). */
static void scaled_rows(const float *x, int64_t rows, int64_t K, int bits, float *out) {
    const int n = PL_STEP_FEATURES(bits);
    const int *offset = bits == 4 ? avx2_offset4 : avx2_offset8;
    float scale[8];
    for (int i = 0; i < n; i++) scale[i] = 1.0f / (float)(1u << offset[i]);
    for (int64_t m = 0; m < rows; m++)
        for (int64_t k = 0; k < K; k += n)
            for (int i = 0; i < n; i++) out[m * K + k + i] = x[m * K + k + i] * scale[i];
}

/* 16 outputs as two halves of 8 lanes; up to AVX2_TILE rows a tile (16 ymm registers); C
 * chains of FMAs per row and half, so that one row is not bound by the FMA's latency. One
 * 4-bit row takes two: with four, its eight sums, two levels, their masks and the activation
 * outgrow the 16 registers and the compiler keeps sums on the stack (a 2-core Zen 3: a step's
 * 4-bit layers at one row ~3.4 ms with two, ~3.8 with four; `bench.linear --quantized`); an
 * 8-bit row, four levels a step, keeps four (two were 4% slower). */
#define AVX2_TILE 4
static inline __attribute__((always_inline)) void panel_avx2_rows(
    const struct sb_wq *w, const uint8_t *panel, const WqRows *x, int64_t m0, const int bits,
    const int R, float out[WQ_ROWS][PL_NR]) {
    const int64_t gs = w->group_size, lb = level_bytes(w), bb = block_bytes(w);
    const int half = (int)w->half_params, per_step = PL_STEP_FEATURES(bits);
    const int C = R >= 3 ? 1 : (R == 1 && bits == 8 ? 4 : 2);
    const int *offset = bits == 4 ? avx2_offset4 : avx2_offset8;
    const int top = per_step - 1, top_shift = bits; /* the top level: shifted down first */
    const float *xr[AVX2_TILE];
    for (int r = 0; r < R; r++) xr[r] = (const float *)x->prepared + (m0 + r) * x->K;
    memset(out, 0, sizeof(float) * WQ_ROWS * PL_NR);
    for (int64_t g = 0; g < x->G; g++) {
        const uint8_t *b = panel + g * bb;
        __m256 part[AVX2_TILE][2][4];
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < C; c++) part[r][h][c] = _mm256_setzero_ps();
        for (int64_t o = 0; o < gs / per_step; o++) {
            const int64_t k0 = g * gs + o * per_step;
            const uint8_t *step = b + o * PL_STEP_BYTES;
            __builtin_prefetch(step + WQ_PREFETCH_BYTES);
            const __m256i v[2] = {_mm256_loadu_si256((const __m256i *)step),
                                  _mm256_loadu_si256((const __m256i *)(step + 32))};
#pragma GCC unroll 8
            for (int f = 0; f < per_step; f++) {
                const __m256i mask = _mm256_set1_epi32((bits == 4 ? 0x0f : 0xff) << offset[f]);
                __m256 q[2];
                for (int h = 0; h < 2; h++)
                    q[h] = _mm256_cvtepi32_ps(_mm256_and_si256(
                        f == top ? _mm256_srli_epi32(v[h], top_shift) : v[h], mask));
                for (int r = 0; r < R; r++) {
                    const __m256 a = _mm256_set1_ps(xr[r][k0 + f]);
                    for (int h = 0; h < 2; h++)
                        part[r][h][f % C] = _mm256_fmadd_ps(q[h], a, part[r][h][f % C]);
                }
            }
        }
        __builtin_prefetch(b + lb + WQ_PREFETCH_BYTES);      /* the scales */
        __builtin_prefetch(b + lb + 64 + WQ_PREFETCH_BYTES); /* the zeros */
        for (int h = 0; h < 2; h++) {
            __m256 s = params256(b + lb, half, 0, h), z = params256(b + lb, half, 1, h);
            for (int r = 0; r < R; r++) {
                __m256 sum = part[r][h][0];
                for (int c = 1; c < C; c++) sum = _mm256_add_ps(sum, part[r][h][c]);
                sum = _mm256_fnmadd_ps(z, _mm256_set1_ps(x->xsum[(m0 + r) * x->G + g]), sum);
                __m256 a = _mm256_loadu_ps(out[r] + 8 * h);
                _mm256_storeu_ps(out[r] + 8 * h, _mm256_fmadd_ps(s, sum, a));
            }
        }
    }
}

/* AVX2 tiles hold at most AVX2_TILE rows (wq_pick's tile), so counts past it never come here. */
#define panel_avx2_capped(w, p, x, m0, bits, R, out) \
    panel_avx2_rows(w, p, x, m0, bits, (R) > AVX2_TILE ? AVX2_TILE : (R), out)
WQ_DISPATCH(panel_avx2, panel_avx2_capped)
#define HAVE_AVX2_PATH 1
#endif

/* Which loops: 0 the widest this CPU has, 1 AVX2's, 2 the portable ones (tests run each);
 * *tile: the most rows one call of the loop takes. */
static WqPanel wq_pick(int path, int bf16_rows, int *tile) {
#if defined(HAVE_BF16_PATH)
    if (path == 0 && bf16_rows) return *tile = WQ_ROWS, panel_bf16;
#else
    (void)bf16_rows;
#endif
#if defined(HAVE_AVX512_PATH)
    if (path == 0) return *tile = WQ_ROWS, panel_avx512;
#endif
#if defined(HAVE_AVX2_PATH)
    if (path <= 1) return *tile = AVX2_TILE, panel_avx2;
#endif
    (void)path;
    *tile = WQ_ROWS;
    return panel_portable;
}

/* The loops this build has, as a bit mask: 1 AVX-512, 2 AVX2, 4 portable, 8 AVX512-BF16
 * (bf16 rows, part of path 0). */
int sb_wq_paths(void) {
    int mask = 4;
#if defined(HAVE_BF16_PATH)
    mask |= 8;
#endif
#if defined(HAVE_AVX512_PATH)
    mask |= 1;
#endif
#if defined(HAVE_AVX2_PATH)
    mask |= 2;
#endif
    return mask;
}

/* Semantics: y = x W^T (+ bias) (+ res), summed in fp32: x [rows, in] fp32 when x_fp32 else
 * bf16; res (nullable; may be y itself) and y [rows, out] fp32 when out_fp32 else bf16 (one
 * rounding); all contiguous. Returns 0, or -1 if memory for the widened rows ran out. */
int sb_wq_linear(const struct sb_wq *w, const void *x, int x_fp32, int64_t rows, const void *res,
                 void *y, int out_fp32, int path) {
    const int64_t K = w->in_features, N = w->out_features, G = K / w->group_size;
#if defined(HAVE_BF16_PATH)
    const int64_t unpacked_rows_from = w->bits == 4 ? UNPACKED_MIN_ROWS4 : UNPACKED_MIN_ROWS8;
    if (path == 0 && !x_fp32 && rows >= unpacked_rows_from)
        return unpacked_linear(w, (const uint16_t *)x, rows, res, y, out_fp32);
#endif
    float *wide = x_fp32 ? NULL : malloc(sizeof(float) * (size_t)(rows * K));
    float *xsum = malloc(sizeof(float) * (size_t)(rows * G));
    if ((!x_fp32 && !wide) || !xsum) {
        free(wide), free(xsum);
        return -1;
    }
    const float *xf = x_fp32 ? (const float *)x : wide;
    for (int64_t m = 0; m < rows; m++) {
        if (!x_fp32) as_f32((const uint16_t *)x + m * K, K, 0, wide + m * K);
        group_sums(xf + m * K, G, w->group_size, xsum + m * G);
    }
    int tile;
    const int bf16_rows = !x_fp32;
    WqPanel loop = wq_pick(path, bf16_rows, &tile);
    void *prepared = NULL; /* the rows as the picked loop takes them, where it wants them so */
    int unprepared = 0;
#if defined(HAVE_BF16_PATH)
    if (loop == panel_bf16) {
        prepared = malloc(sizeof(uint16_t) * (size_t)(rows * K));
        if (prepared) bf16_pairs((const uint16_t *)x, rows, K, (int)w->bits, prepared);
        unprepared = !prepared;
    }
#endif
#if defined(HAVE_AVX2_PATH)
    if (loop == panel_avx2) {
        prepared = malloc(sizeof(float) * (size_t)(rows * K));
        if (prepared) scaled_rows(xf, rows, K, (int)w->bits, prepared);
        unprepared = !prepared;
    }
#endif
    if (unprepared) {
        free(wide), free(xsum);
        return -1;
    }
    WqRows xr = {xf, xsum, K, G, prepared};
    const int64_t num_panels = (N + PL_NR - 1) / PL_NR, panel_bytes = G * block_bytes(w);
#pragma omp parallel for schedule(static) if (num_panels > 1)
    for (int64_t p = 0; p < num_panels; p++) {
        const int64_t n0 = p * PL_NR;
        const int cols = N - n0 < PL_NR ? (int)(N - n0) : PL_NR;
        for (int64_t m0 = 0; m0 < rows; m0 += tile) {
            const int t = rows - m0 < tile ? (int)(rows - m0) : tile;
            float acc[WQ_ROWS][PL_NR];
            loop(w, w->blocks + p * panel_bytes, &xr, m0, t, acc);
            for (int r = 0; r < t; r++)
                pl_store_row(acc[r], cols, w->bias ? w->bias + n0 : NULL, res, y,
                             (m0 + r) * N + n0, out_fp32);
        }
    }
    free(wide), free(xsum), free(prepared);
    return 0;
}
