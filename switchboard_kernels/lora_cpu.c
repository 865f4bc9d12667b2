/* Batched multi-LoRA on CPU for bf16 and fp32 models: shrink (x A^T) and expand (+= scale
 * h B^T) over tokens grouped by adapter slot, in one call per projection group.
 *
 * Why native code: on CPU a LoRA pair through torch pays a fixed overhead per matmul call
 * (oneDNN dispatch, casts, temporaries; docs/performance.md), and a decode step of the
 * default model makes 120 such pairs per adapter present, so 32 distinct adapters cost more
 * in overhead than in bytes. Here every group of tokens of one adapter reads that adapter's weights
 * once, at the rank it really has, and the whole batch is one call.
 *
 * Compiled at run time by switchboard_kernels/lora_native.py with the host's C compiler and
 * -march=native, so the AVX-512 path (bf16) is used exactly where the CPU has it; the
 * portable path (plain C the compiler vectorizes: omp simd) is compiled always and is what
 * fp32 and other CPUs run. Tests check both against the torch references.
 *
 * Layout of one slot's weights (switchboard_kernels/lora_native.py builds it; see NativeSlot there):
 *   table row of SLOT_FIELDS int64: a_ptr, rank, n_blocks, then per block
 *   (row_begin, row_end, out_begin, out_end, bt_ptr).
 *   a: [rank, in] row-major, the adapter's A cut to its real rank (the model's dtype).
 *   block b: rank rows [row_begin, row_end) feed outputs [out_begin, out_end) through
 *   bt: [ceil(out / 16), row_end - row_begin, 16] (out = out_end - out_begin), B's
 *   block in tiles of 16 output columns, zero-padded: the expand reads it front to back.
 * The slot's a and tiles sit in one buffer, in that order, so a work item is one stream.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define MAX_BLOCKS 3
#define SLOT_FIELDS (3 + 5 * MAX_BLOCKS)
#define TOKEN_BLOCK 8  /* tokens that share each weight load */
/* How far ahead of its loads an item asks for its weights. An item's stream is short (35-135
 * KB at the default model's shapes) and lies on 4 KB pages, where the hardware prefetcher
 * stops at each page's end and starts again cold; with several tokens per item the loads
 * then waited on memory and the arithmetic on the loads, one after the other. Asked 4 KB
 * ahead, a decode step's 120 calls over 8 adapters of 4 tokens each took 2.2 instead of 4.1
 * ms on a 2-core Zen 5 (1 to 4 KB alike, L1 or L2 alike; docs/performance.md). */
#define PREFETCH_BYTES 4096

/* --- portable inner loops ------------------------------------------------------------ */

/* x [nt, in] times each of A's rank rows, each token's dot product summed in one order
 * whatever the pointers' alignment: SHRINK_LANES partial sums, combined pairwise, then the
 * tail. (A reduction the compiler vectorizes may peel iterations until an operand is aligned,
 * so its order followed where the scratch rows sat in memory, and a row's bits followed the
 * batch around it: batch_invariant.) The tokens go side by side, so that each row is widened
 * and loaded once and nt independent sums hide the FMA's latency (one token at a time, a
 * decode step's 120 calls over 8 adapters of 4 tokens took 1.2-1.35x as long on a Zen 3). */
#define SHRINK_LANES 16
static inline __attribute__((always_inline)) void shrink_portable_n(
    const float *x32, int64_t in, const void *a, int fp32, int64_t rank, const int nt, float *h,
    int64_t h_stride, float *row_buf) {
    int64_t size = fp32 ? 4 : 2;
    for (int64_t i = 0; i < rank; i++) {
        const float *row = as_f32((const char *)a + i * in * size, in, fp32, row_buf);
        float part[TOKEN_BLOCK][SHRINK_LANES] = {{0.0f}};
        int64_t k = 0;
        for (; k + SHRINK_LANES <= in; k += SHRINK_LANES)
            for (int t = 0; t < nt; t++) {
#pragma omp simd
                for (int j = 0; j < SHRINK_LANES; j++)
                    part[t][j] += x32[t * in + k + j] * row[k + j];
            }
        for (int t = 0; t < nt; t++) {
            for (int width = SHRINK_LANES / 2; width > 0; width /= 2)
                for (int j = 0; j < width; j++) part[t][j] += part[t][j + width];
            float acc = part[t][0];
            for (int64_t kk = k; kk < in; kk++) acc += x32[t * in + kk] * row[kk];
            h[t * h_stride + i] = acc;
        }
    }
}

/* nt tokens of an item at a time, the count a compile-time constant at each call
 * (DISPATCH_NT), so that loops over tokens unroll and their accumulators stay in registers. */
#define DISPATCH_NT(call)                                                  \
    switch (nt) {                                                          \
    case 1: call(1); break; case 2: call(2); break; case 3: call(3); break; \
    case 4: call(4); break; case 5: call(5); break; case 6: call(6); break; \
    case 7: call(7); break; default: call(8); break;                      \
    }

/* Tile by tile (16 output columns), as the AVX-512 loop: each weight is read once for all
 * nt tokens. */
static inline __attribute__((always_inline)) void expand_portable_n(
    const float *h, int64_t h_stride, const void *bt, int fp32, int64_t rb, int64_t re,
    int64_t width, const int nt, void *const *ys, float scale) {
    int64_t size = fp32 ? 4 : 2, r = re - rb;
    float wbuf[16];
    for (int64_t c = 0; c < width; c += 16) {
        float acc[TOKEN_BLOCK][16] = {{0.0f}};
        const char *tile = (const char *)bt + (c / 16) * r * 16 * size;
        for (int64_t i = 0; i < r; i++) {
            const float *w = as_f32(tile + i * 16 * size, 16, fp32, wbuf);
            for (int t = 0; t < nt; t++) {
                float ht = h[t * h_stride + rb + i];
#pragma omp simd
                for (int j = 0; j < 16; j++) acc[t][j] += ht * w[j];
            }
        }
        int64_t n = width - c < 16 ? width - c : 16;
        for (int t = 0; t < nt; t++) {
            if (fp32) {
                float *y = (float *)ys[t] + c;
                for (int64_t j = 0; j < n; j++) y[j] += scale * acc[t][j];
            } else {
                uint16_t *y = (uint16_t *)ys[t] + c;
                for (int64_t j = 0; j < n; j++)
                    y[j] = f32_to_bf16(bf16_to_f32(y[j]) + scale * acc[t][j]);
            }
        }
    }
}

static void expand_portable(const float *h, int64_t h_stride, const void *bt, int fp32,
                            int64_t rb, int64_t re, int64_t width, int64_t nt,
                            void *const *ys, float scale) {
#define EXPAND(n) expand_portable_n(h, h_stride, bt, fp32, rb, re, width, n, ys, scale)
    DISPATCH_NT(EXPAND)
#undef EXPAND
}

static void shrink_portable(const float *x32, int64_t in, const void *a, int fp32,
                            int64_t rank, int64_t nt, float *h, int64_t h_stride,
                            float *row_buf) {
#define SHRINK(n) shrink_portable_n(x32, in, a, fp32, rank, n, h, h_stride, row_buf)
    DISPATCH_NT(SHRINK)
#undef SHRINK
}

/* --- AVX-512 inner loops ------------------------------------------------------------- */
#if defined(__AVX512F__)

/* nt is a compile-time constant at each call site below, so the accumulators stay in
 * registers. */
static inline __attribute__((always_inline)) void shrink_avx512_n(
    const float *x32, int64_t in, const uint16_t *a, int64_t rank, const int nt,
    float *h, int64_t h_stride) {
    for (int64_t i = 0; i < rank; i++) {
        const uint16_t *row = a + i * in;
        __m512 acc[TOKEN_BLOCK];
        for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t k = 0; k < in; k += 16) {
            __mmask16 m = tail_mask(in - k);
            _mm_prefetch((const char *)(row + k) + PREFETCH_BYTES, _MM_HINT_T0);
            __m512 w = load_bf16(row + k, m);
            for (int t = 0; t < nt; t++)
                acc[t] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, x32 + t * in + k), acc[t]);
        }
        for (int t = 0; t < nt; t++) h[t * h_stride + i] = _mm512_reduce_add_ps(acc[t]);
    }
}

static inline __attribute__((always_inline)) void expand_avx512_n(
    const float *h, int64_t h_stride, const uint16_t *bt, int64_t rb, int64_t re,
    int64_t width, const int nt, uint16_t *const *ys, float scale) {
    __m512 vscale = _mm512_set1_ps(scale);
    const uint16_t *tile = bt;
    for (int64_t c = 0; c < width; c += 16, tile += (re - rb) * 16) {
        __mmask16 m = tail_mask(width - c);
        __m512 acc[TOKEN_BLOCK];
        for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t i = rb; i < re; i++) {
            _mm_prefetch((const char *)(tile + (i - rb) * 16) + PREFETCH_BYTES, _MM_HINT_T0);
            __m512 w = load_bf16(tile + (i - rb) * 16, 0xffff); /* tiles are zero-padded */
            for (int t = 0; t < nt; t++)
                acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(h[t * h_stride + i]), w, acc[t]);
        }
        for (int t = 0; t < nt; t++) {
            __m512 y = load_bf16(ys[t] + c, m);
            store_bf16(ys[t] + c, _mm512_fmadd_ps(acc[t], vscale, y), m);
        }
    }
}

static void shrink_avx512(const float *x32, int64_t in, const uint16_t *a, int64_t rank,
                          int64_t nt, float *h, int64_t h_stride) {
#define SHRINK(n) shrink_avx512_n(x32, in, a, rank, n, h, h_stride)
    DISPATCH_NT(SHRINK)
#undef SHRINK
}

static void expand_avx512(const float *h, int64_t h_stride, const uint16_t *bt, int64_t rb,
                          int64_t re, int64_t width, int64_t nt, uint16_t *const *ys,
                          float scale) {
#define EXPAND(n) expand_avx512_n(h, h_stride, bt, rb, re, width, n, ys, scale)
    DISPATCH_NT(EXPAND)
#undef EXPAND
}
#endif /* __AVX512F__ */

/* --- the batch ----------------------------------------------------------------------- */

/* 1 when this build has the AVX-512 loops (the compiler saw -march=native on such a CPU). */
int sb_lora_has_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* One work item: up to TOKEN_BLOCK tokens of one group, shrink then expand. An item reads
 * its slot's weights front to back (A, then each B block), one sequential stream. */
static void run_item(const void *x, int64_t x_stride, int64_t in, void *y, int64_t y_stride,
                     const int64_t *slot, float scale, const int64_t *rows, int64_t nt,
                     int fp32, int use_avx512, float *scratch) {
    (void)use_avx512; /* unused where the build has no AVX-512 loops */
    int64_t size = fp32 ? 4 : 2;
    float *x32 = scratch;                        /* [nt, in] */
    float *row_buf = scratch + TOKEN_BLOCK * in; /* [in] */
    float *h = row_buf + in;                     /* [nt, rank] */
    void *ys[TOKEN_BLOCK];
    for (int64_t t = 0; t < nt; t++)
        for (int64_t k = 0; k < in; k++)
            x32[t * in + k] = fp32 ? ((const float *)x)[rows[t] * x_stride + k]
                                   : bf16_to_f32(((const uint16_t *)x)[rows[t] * x_stride + k]);
    const void *a = (const void *)(intptr_t)slot[0];
#if defined(__AVX512F__)
    if (use_avx512)
        shrink_avx512(x32, in, (const uint16_t *)a, slot[1], nt, h, slot[1]);
    else
#endif
        shrink_portable(x32, in, a, fp32, slot[1], nt, h, slot[1], row_buf);
    for (int64_t b = 0; b < slot[2]; b++) {
        const int64_t *blk = slot + 3 + 5 * b;
        const void *bt = (const void *)(intptr_t)blk[4];
        for (int64_t t = 0; t < nt; t++) ys[t] = (char *)y + (rows[t] * y_stride + blk[2]) * size;
#if defined(__AVX512F__)
        if (use_avx512)
            expand_avx512(h, slot[1], (const uint16_t *)bt, blk[0], blk[1], blk[3] - blk[2], nt,
                          (uint16_t *const *)ys, scale);
        else
#endif
            expand_portable(h, slot[1], bt, fp32, blk[0], blk[1], blk[3] - blk[2], nt, ys, scale);
    }
}

/* Semantics: for each group g of slot s = group_slot[g] and each token row t among
 * rows[group_start[g] : group_start[g+1]]:
 *     y[t, :] += scales[s] * (x[t, :] @ A_s^T) @ B_s^T                     (fp32 sums)
 * where y already points at the projection's first output column.
 *   x: [T, in], row stride x_stride;  y: [T, >= out], row stride y_stride
 *   x, y and the slots' weights all bf16 (fp32 = 0) or all fp32 (fp32 = 1)
 *   table: [num_slots, SLOT_FIELDS] int64;  scales: [num_slots] float32
 *   portable: 1 forces the plain-C loops (tests compare both with the reference).
 * Returns 0, or -1 if scratch memory ran out (then some rows are not updated).
 * Work items are (group, block of up to TOKEN_BLOCK tokens), spread over torch's OpenMP
 * threads; a group of many tokens is several items that read its weights from cache.
 */
int sb_lora_bgmv(const void *x, int64_t x_stride, int64_t in, void *y, int64_t y_stride,
                 const int64_t *table, const float *scales, int64_t n_groups,
                 const int64_t *group_slot, const int64_t *group_start, const int64_t *rows,
                 int fp32, int portable) {
    int use_avx512 = sb_lora_has_avx512() && !portable && !fp32;
    int64_t n_items = 0, max_rank = 0, failed = 0;
    for (int64_t g = 0; g < n_groups; g++) {
        int64_t rank = table[group_slot[g] * SLOT_FIELDS + 1];
        max_rank = rank > max_rank ? rank : max_rank;
        n_items += (group_start[g + 1] - group_start[g] + TOKEN_BLOCK - 1) / TOKEN_BLOCK;
    }
#pragma omp parallel reduction(| : failed) if (n_items > 1)
    {
        /* Per thread: an item's rows in fp32 and their shrink output (heap, not stack: a
         * wide projection input would not fit a worker thread's stack). */
        float *scratch = malloc(sizeof(float) * (TOKEN_BLOCK * (in + max_rank) + in));
        if (!scratch) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_items; it++) {
            int64_t g = 0, k = it; /* the it-th item: walk the groups (few; cheaper than a list) */
            for (;; g++) {
                int64_t count = (group_start[g + 1] - group_start[g] + TOKEN_BLOCK - 1) / TOKEN_BLOCK;
                if (k < count) break;
                k -= count;
            }
            const int64_t *slot = table + group_slot[g] * SLOT_FIELDS;
            int64_t t0 = group_start[g] + k * TOKEN_BLOCK;
            int64_t t1 = t0 + TOKEN_BLOCK < group_start[g + 1] ? t0 + TOKEN_BLOCK : group_start[g + 1];
            if (scratch && slot[1] > 0)
                run_item(x, x_stride, in, y, y_stride, slot, scales[group_slot[g]], rows + t0,
                         t1 - t0, fp32, use_avx512, scratch);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* DoRA's rescale, after sb_lora_bgmv added the LoRA delta into the same rows.
 * Semantics: for each group g whose slot s = group_slot[g] has enabled[s] != 0, and each
 * token row t among rows[group_start[g] : group_start[g+1]]:
 *     y[t, j] = z[t, j] + scales[s, j] * (y[t, j] - z[t, j])        for j < out (fp32 math)
 * where z is base (row stride base_stride: 0 repeats one vector, e.g. a bias) or 0 when
 * base is NULL: the part of y that is not the projection's W x + delta (a bias or a
 * residual added into the same output).
 *   y: [T, >= out] bf16 (fp32 = 0) or fp32 (fp32 = 1), row stride y_stride; base: y's dtype
 *   scales: [num_slots, out] float32 row-major;  enabled: [num_slots] int64
 * Rows of other groups (plain LoRA, no adapter) are not touched.
 */
void sb_lora_dora(void *y, int64_t y_stride, int64_t out, const float *scales,
                  const int64_t *enabled, const void *base, int64_t base_stride,
                  int64_t n_groups, const int64_t *group_slot, const int64_t *group_start,
                  const int64_t *rows, int fp32) {
    /* One pass over a row's outputs: cheap beside the LoRA that wrote them (serial). */
    for (int64_t g = 0; g < n_groups; g++) {
        if (!enabled[group_slot[g]]) continue;
        const float *gs = scales + group_slot[g] * out;
        for (int64_t i = group_start[g]; i < group_start[g + 1]; i++) {
            int64_t t = rows[i];
            if (fp32) {
                float *yt = (float *)y + t * y_stride;
                const float *zt = base ? (const float *)base + t * base_stride : NULL;
                if (zt) {
#pragma omp simd
                    for (int64_t j = 0; j < out; j++) yt[j] = zt[j] + gs[j] * (yt[j] - zt[j]);
                } else {
#pragma omp simd
                    for (int64_t j = 0; j < out; j++) yt[j] = gs[j] * yt[j];
                }
            } else {
                uint16_t *yt = (uint16_t *)y + t * y_stride;
                const uint16_t *zt = base ? (const uint16_t *)base + t * base_stride : NULL;
                for (int64_t j = 0; j < out; j++) {
                    float z = zt ? bf16_to_f32(zt[j]) : 0.0f;
                    yt[j] = f32_to_bf16(z + gs[j] * (bf16_to_f32(yt[j]) - z));
                }
            }
        }
    }
}
