/* Decode attention straight from the paged KV cache on CPU, bf16 or fp32 (PagedAttention,
 * Kwon et al., SOSP 2023): each decoding sequence's queries against its own blocks, read in
 * place. Hand-written AVX-512 loops serve bf16 where the CPU has them; fp32, and bf16
 * elsewhere, take 8-wide loops in GCC's vector extensions (AVX2, NEON, ...) where head_dim
 * is a multiple of 8; the portable loops (omp simd) serve the rest.
 *
 * Why native code: the torch path gathers each sequence's blocks into a padded copy, then
 * runs SDPA with a mask over the padding, so K and V cross memory three times and short
 * sequences pay for long ones; here each key and value is read once, where it lies, and
 * only up to each query's own position. Built by switchboard_kernels/native.py (-march=native); the
 * portable loops are compiled always and tests check each path against a float64 loop.
 *
 * Cache layout (switchboard_kernels/paged_attention.py): [num_blocks, block_size, kv_heads, head_dim].
 * Query head h reads KV head h / (heads / kv_heads) (grouped-query attention). A sequence
 * feeds n queries (1, or k + 1 when a speculative step verifies k drafts); query i sits at
 * position start + i and sees keys 0 .. start + i. An alternative draft (verified beside a
 * chain of drafts, in a slot past the chain) is its own one-query sequence whose last key,
 * at its own position, is read from that slot instead of from the table ("own slot").
 *
 * A context past SPLIT_KEYS keys is read in parts of that many keys, each part a work item
 * whose rows are normalized over its own keys, then merged by their largest scores and sums
 * of exps (flash-decoding's split-K): a lone long sequence's KV heads then fill both cores.
 *
 * Two departures some model families take (sb_paged_decode_windowed): a sliding window W, in
 * which a query at position p sees only keys p - W < j <= p (the keys before the first block
 * any row sees are never read), and a soft-cap on the scores, cap * tanh(s / cap), before the
 * softmax (Gemma 2).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "exp_avx512.h"

#define MAX_HEAD_DIM 256
#define CHUNK_QUERIES 4 /* queries of one sequence per work item (see sb_paged_decode) */

/* One work item: the queries of one sequence that read `heads_walked` KV heads from kv_head
 * on (the heads of each one's group at each of its n positions: head_rows = group * n rows a
 * KV head, row r = KV head kv_head + r / head_rows, query i = (r % head_rows) / group, head
 * h0 + r % group). Keys are walked block by block, and each key and value is loaded once for
 * all rows of its KV head. */
typedef struct {
    const char *key_cache, *value_cache;
    int64_t elem_bytes;    /* 2 (bf16) or 4 (fp32) */
    int64_t block_size, kv_heads, head_dim;
    const int64_t *table;  /* this sequence's blocks */
    int64_t kv_head, heads_walked;
    int64_t rows, group;   /* rows = heads_walked * head_rows */
    int64_t head_rows;     /* group * queries */
    int64_t first_len;     /* keys query i sees: first_len + i */
    int64_t stride;        /* of the scores scratch: the most keys, rounded up to 16 */
    int64_t own_index;     /* the key read from own_slot instead of the table; -1: none */
    int64_t own_slot;      /* flat slot (block * block_size + offset) */
    int64_t window;        /* sliding window W (row r sees keys visible - W ..); 0: none */
    float softcap;         /* scores -> softcap * tanh(scores / softcap); 0: none */
    int64_t key_lo, key_hi; /* the item's part of the keys (see SPLIT_KEYS) */
    float *stats;          /* NULL, or [rows, 2]: each row's largest score and sum of exps */
} Item;

/* The query row r belongs to. */
static inline int64_t query_of(const Item *it, int64_t r) {
    return r % it->head_rows / it->group;
}

/* Keys row r sees: up to its own position, within the item's part. */
static inline int64_t visible(const Item *it, int64_t r) {
    int64_t n = it->first_len + query_of(it, r);
    return n < it->key_hi ? n : it->key_hi;
}

/* The first key row r sees: its window's start (from its own position), or the part's. */
static inline int64_t first_seen(const Item *it, int64_t r) {
    int64_t lo = it->window > 0 ? it->first_len + query_of(it, r) - it->window : 0;
    return lo > it->key_lo ? lo : it->key_lo;
}

/* The first key any row reads, at the start of its block (row 0 sees the fewest keys). */
static inline int64_t first_walked(const Item *it) {
    return first_seen(it, 0) / it->block_size * it->block_size;
}

/* Key (or value) j of the item's KV head, walked block by block (no division per key). */
static inline const char *block_rows(const Item *it, const char *cache, int64_t b) {
    return cache + (it->table[b] * it->block_size * it->kv_heads + it->kv_head) * it->head_dim *
                       it->elem_bytes;
}

/* Blocks lie anywhere in the cache, so the hardware prefetcher cannot guess the next one: the
 * walk asks for the rows PREFETCH_KEYS keys (whole blocks, at least one) ahead of the block
 * it reads. Into L2 (prefetcht2), not L1: a prefetch to L1 holds one of the core's few L1
 * miss buffers until its line arrives, so scattered prefetches to L1 were no faster than
 * none, while L2's many buffers keep enough lines in flight (bench/decode_attention.py). */
#ifndef PREFETCH_KEYS
#define PREFETCH_KEYS 32
#endif

static inline int64_t blocks_ahead(const Item *it) {
    return PREFETCH_KEYS > it->block_size ? PREFETCH_KEYS / it->block_size : 1;
}

/* Block b's rows of the item's KV head, those of its keys below len. */
static inline void prefetch_block(const Item *it, const char *cache, int64_t b, int64_t len) {
    int64_t count = len - b * it->block_size;
    if (count <= 0) return;
    count = count < it->block_size ? count : it->block_size;
    const char *rows = block_rows(it, cache, b);
    int64_t step = it->kv_heads * it->head_dim * it->elem_bytes;
    int64_t bytes = it->heads_walked * it->head_dim * it->elem_bytes;
    for (int64_t o = 0; o < count; o++)
        for (int64_t line = 0; line < bytes; line += 64)
            __builtin_prefetch(rows + o * step + line, 0, 1);
}

/* The blocks a walk from key `first` reads before its own prefetches arrive. */
static inline void prefetch_first(const Item *it, const char *cache, int64_t first, int64_t len) {
    for (int64_t b = first / it->block_size, n = 0; n < blocks_ahead(it); b++, n++)
        prefetch_block(it, cache, b, len);
}

/* The item's KV head in the given flat slot (the own slot). */
static inline const char *slot_row(const Item *it, const char *cache, int64_t slot) {
    return cache + (slot * it->kv_heads + it->kv_head) * it->head_dim * it->elem_bytes;
}

#define FOR_EACH_KEY(it, cache, len, j, ptr, ...)                                       \
    prefetch_first((it), (cache), first_walked(it), (len));                             \
    for (int64_t blk_ = first_walked(it) / (it)->block_size, j = first_walked(it);       \
         j < (len); blk_++) {                                                           \
        const char *row_ = block_rows((it), (cache), blk_);                             \
        prefetch_block((it), (cache), blk_ + blocks_ahead(it), (len));                  \
        for (int64_t o_ = 0; o_ < (it)->block_size && j < (len); o_++, j++,             \
                     row_ += (it)->kv_heads * (it)->head_dim * (it)->elem_bytes) {      \
            const char *ptr = j == (it)->own_index                                      \
                                  ? slot_row((it), (cache), (it)->own_slot) : row_;     \
            __VA_ARGS__                                                                 \
        }                                                                               \
    }

/* e^f for |f| <= ln(2)/2, its series to f^6 by Horner's rule, p holding 1/720 on entry:
 * one body for the scalar and the 8-wide exp below. */
#define EXP_SERIES_FROM_720TH(p, f)                                                      \
    do {                                                                                  \
        p = p * f + 1.0f / 120;                                                           \
        p = p * f + 1.0f / 24;                                                            \
        p = p * f + 1.0f / 6;                                                             \
        p = p * f + 0.5f;                                                                 \
        p = p * f + 1.0f;                                                                 \
        p = p * f + 1.0f;                                                                 \
    } while (0)

/* e^x for x <= 0 in plain C that vectorizes (libm's expf does not without -ffast-math):
 * x = n ln2 + f ln2 with |f| <= 1/2, 2^f by its degree-6 Taylor polynomial (relative error
 * < 2e-7), 2^n built in the exponent bits. Below -87 (e^-87 ~ 1.6e-38) it clamps. */
#pragma omp declare simd notinbranch
static inline float exp_nonpositive_f32(float x) {
    float t = (x < -87.0f ? -87.0f : x) * 1.44269504089f;
    float n = floorf(t + 0.5f);
    float f = (t - n) * 0.69314718056f;
    float p = 1.0f / 720;
    EXP_SERIES_FROM_720TH(p, f);
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* A part's row: its largest score and sum of exps, for the merge (-inf and 0 for no keys). */
static inline void keep_stats(const Item *it, int64_t r, float max, float sum) {
    if (it->stats) {
        it->stats[2 * r] = max;
        it->stats[2 * r + 1] = sum;
    }
}

/* Row r's scores over its keys [lo, n): the soft-cap applied where there is one, and the keys
 * before the window zeroed (they take no part; the weighted sum of values reads them as 0).
 * tanh(x) = sign(x) (1 - e) / (1 + e) with e = e^(-2|x|). */
static void prepare_row(const Item *it, float *sr, int64_t lo, int64_t n) {
    for (int64_t j = first_walked(it); j < lo; j++) sr[j] = 0.0f;
    if (it->softcap > 0.0f) {
        float cap = it->softcap;
        for (int64_t j = lo; j < n; j++) {
            float x = sr[j] / cap, e = exp_nonpositive_f32(-2.0f * fabsf(x));
            float t = (1.0f - e) / (1.0f + e);
            sr[j] = cap * (x < 0.0f ? -t : t);
        }
    }
}

/* The inner loops of attend_portable, out of its FOR_EACH_KEY bodies (a pragma cannot sit
 * in a macro argument). */
static inline float dot_f32(const float *a, const float *b, int64_t d) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < d; c++) s += a[c] * b[c];
    return s;
}

static inline void add_scaled_f32(float *out, float p, const float *v, int64_t d) {
#pragma omp simd
    for (int64_t c = 0; c < d; c++) out[c] += p * v[c];
}

/* Each row's scores -> probabilities over its visible keys, zeros up to len. */
static void softmax_rows(const Item *it, float *scores, int64_t len) {
    for (int64_t r = 0; r < it->rows; r++) {
        float *sr = scores + r * it->stride, max = -INFINITY, sum = 0.0f;
        int64_t n = visible(it, r), lo = first_seen(it, r);
        prepare_row(it, sr, lo, n);
#pragma omp simd reduction(max : max)
        for (int64_t j = lo; j < n; j++) max = sr[j] > max ? sr[j] : max;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = lo; j < n; j++) {
            sr[j] = exp_nonpositive_f32(sr[j] - max);
            sum += sr[j];
        }
        keep_stats(it, r, max, sum);
        float inv = 1.0f / sum;
        for (int64_t j = lo; j < len; j++) sr[j] = j < n ? sr[j] * inv : 0.0f;
    }
}

/* q: [rows, head_dim] fp32; scores: [rows, len] scratch; out: [rows, head_dim] fp32. */
static void attend_portable(const Item *it, const float *q, float scale, float *scores,
                            float *out) {
    int64_t d = it->head_dim, rows = it->rows, len = visible(it, rows - 1);
    float buf[MAX_HEAD_DIM];
    FOR_EACH_KEY(it, it->key_cache, len, j, key, {
        const float *k = as_f32(key, d, it->elem_bytes == 4, buf);
        for (int64_t r = 0; r < rows; r++) scores[r * it->stride + j] = dot_f32(q + r * d, k, d) * scale;
    })
    prefetch_first(it, it->value_cache, first_walked(it), len); /* during the softmax */
    softmax_rows(it, scores, len);
    for (int64_t i = 0; i < rows * d; i++) out[i] = 0.0f;
    FOR_EACH_KEY(it, it->value_cache, len, j, value, {
        const float *v = as_f32(value, d, it->elem_bytes == 4, buf);
        for (int64_t r = 0; r < rows; r++) add_scaled_f32(out + r * d, scores[r * it->stride + j], v, d);
    })
}

/* --- 8-wide vector loops: fp32 caches, and bf16 where AVX-512 is missing ------------------
 * GCC's vector extensions (the compiler maps them to AVX/AVX2+FMA, AVX-512's lower half or
 * NEON), for head_dim a multiple of 8. The portable loops' dot product reduces across its
 * lanes at every key, which dominated a verification's attention on a Zen 3
 * (docs/performance.md); here eight keys' dot products reduce together, and each row's
 * weighted sum of values stays in registers. */
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

static inline v8f load8(const void *p, int fp32) {
    if (fp32) {
        v8f v;
        memcpy(&v, p, sizeof v);
        return v;
    }
#if defined(__AVX2__)
    /* one widening load: GCC lowers the generic conversion below to two 128-bit halves,
     * joined (five instructions a load), which bounded bf16 attention on a Zen 3 */
    return (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    v8u16 h;
    memcpy(&h, p, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u32) << 16);
#endif
}

/* [sum of a[0]'s lanes, ..., sum of a[7]'s]. */
static inline v8f sum_lanes8(const v8f a[8]) {
#if defined(__AVX__)
    __m256 s01 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]);
    __m256 s23 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    __m256 s45 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]);
    __m256 s67 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* lanes 0-3: a[0..3]'s low halves, then high halves; the same for a[4..7] */
    return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                              _mm256_permute2f128_ps(s0123, s4567, 0x31));
#else
    v8f out;
    for (int i = 0; i < 8; i++) {
        float s = 0.0f;
        for (int l = 0; l < 8; l++) s += a[i][l];
        out[i] = s;
    }
    return out;
#endif
}

/* e^x for x <= 0, 8 at a time: exp_nonpositive_f32's method (which the compiler leaves
 * scalar inside the softmax's loops), rounding by the 1.5 * 2^23 trick. */
static inline v8f exp_nonpositive8(v8f x) {
    typedef int32_t v8i __attribute__((vector_size(32)));
    v8f t = x * 1.44269504089f;
    v8i low = t < -125.0f; /* lanes of -1 where 2^t would not be a normal float */
    t = (v8f)(((v8i)t & ~low) | ((v8i)((v8f){0} - 125.0f) & low));
    v8f n = (t + 12582912.0f) - 12582912.0f; /* t rounded to the nearest integer */
    v8f f = (t - n) * 0.69314718056f;
    v8f p = (v8f){0} + 1.0f / 720;
    EXP_SERIES_FROM_720TH(p, f);
    return p * (v8f)((__builtin_convertvector(n, v8i) + 127) << 23);
}

/* softmax_rows, 8 keys at a time. */
static void softmax_rows8(const Item *it, float *scores, int64_t len) {
    for (int64_t r = 0; r < it->rows; r++) {
        float *sr = scores + r * it->stride, max = -INFINITY, sum = 0.0f;
        int64_t n = visible(it, r), lo = first_seen(it, r), j = lo;
        prepare_row(it, sr, lo, n);
        v8f vmax = (v8f){0} - INFINITY, vsum = {0};
        for (; j + 8 <= n; j += 8) {
            v8f v = load8(sr + j, 1);
            vmax = (v8f)(((v8u32)(v > vmax) & (v8u32)v) | (~(v8u32)(v > vmax) & (v8u32)vmax));
        }
        for (int l = 0; l < 8; l++) max = vmax[l] > max ? vmax[l] : max;
        for (; j < n; j++) max = sr[j] > max ? sr[j] : max;
        for (j = lo; j + 8 <= n; j += 8) {
            v8f e = exp_nonpositive8(load8(sr + j, 1) - max);
            memcpy(sr + j, &e, sizeof e);
            vsum += e;
        }
        for (; j < n; j++) {
            sr[j] = exp_nonpositive_f32(sr[j] - max);
            sum += sr[j];
        }
        for (int l = 0; l < 8; l++) sum += vsum[l];
        keep_stats(it, r, max, sum);
        float inv = 1.0f / sum;
        for (j = lo; j < n; j++) sr[j] *= inv;
        for (; j < len; j++) sr[j] = 0.0f;
    }
}

/* scores[r, j0 + i] = scale * q[r] . key i, for the nk <= 8 keys given and every row. */
static inline __attribute__((always_inline)) void score_keys8(
    const Item *it, const char *const keys[8], int nk, int64_t j0, const float *q, float scale,
    float *scores, const int fp32) {
    const int64_t chunks = it->head_dim / 8, step = fp32 ? 32 : 16;
    for (int64_t k = 0, r = 0; k < it->heads_walked; k++) {
        const int64_t head = k * it->head_dim * (fp32 ? 4 : 2); /* KV head k in a token's row */
        for (int64_t e = 0; e < it->head_rows; e++, r++) {
            const float *qr = q + r * it->head_dim;
            v8f acc[8] = {{0}};
            for (int64_t c = 0; c < chunks; c++) {
                v8f qv = load8(qr + 8 * c, 1);
                for (int i = 0; i < 8; i++) acc[i] += qv * load8(keys[i] + head + c * step, fp32);
            }
            v8f s = sum_lanes8(acc) * scale;
            float *to = scores + r * it->stride + j0;
            if (nk == 8)
                memcpy(to, &s, sizeof s);
            else
                for (int i = 0; i < nk; i++) to[i] = s[i];
        }
    }
}

/* VALUES_PER_PASS values at a time (they stay in L1 while every row reads them): out[r] +=
 * sum over the nv values given (keys j0 ..) of p[r, j] value j, 8 CN features from 8 c0 on;
 * CN is a constant at every call site, so each row's sums stay in registers. */
#define VALUES_PER_PASS 16

static inline __attribute__((always_inline)) void weigh_values8(
    const Item *it, const char *const *values, int nv, int64_t j0, const float *scores,
    int64_t c0, float *out, const int cn, const int fp32) {
    const int64_t step = fp32 ? 32 : 16;
    for (int64_t k = 0, r = 0; k < it->heads_walked; k++) {
        const int64_t head = k * it->head_dim * (fp32 ? 4 : 2); /* KV head k in a token's row */
        for (int64_t e = 0; e < it->head_rows; e++, r++) {
            const float *p = scores + r * it->stride + j0;
            float *o = out + r * it->head_dim + 8 * c0;
            v8f acc[8];
            memcpy(acc, o, sizeof(v8f) * cn);
            for (int i = 0; i < nv; i++) {
                v8f w = (v8f){0} + p[i];
                const char *v = values[i] + head;
                for (int c = 0; c < cn; c++) acc[c] += w * load8(v + (c0 + c) * step, fp32);
            }
            memcpy(o, acc, sizeof(v8f) * cn);
        }
    }
}

static inline __attribute__((always_inline)) void weigh_values_pass8(
    const Item *it, const char *const *values, int nv, int64_t j0, const float *scores,
    float *out, const int fp32) {
    int64_t chunks = it->head_dim / 8;
    for (int64_t c0 = 0; c0 < chunks; c0 += 8) {
        switch (chunks - c0 < 8 ? chunks - c0 : 8) {
        case 1: weigh_values8(it, values, nv, j0, scores, c0, out, 1, fp32); break;
        case 2: weigh_values8(it, values, nv, j0, scores, c0, out, 2, fp32); break;
        case 3: weigh_values8(it, values, nv, j0, scores, c0, out, 3, fp32); break;
        case 4: weigh_values8(it, values, nv, j0, scores, c0, out, 4, fp32); break;
        case 5: weigh_values8(it, values, nv, j0, scores, c0, out, 5, fp32); break;
        case 6: weigh_values8(it, values, nv, j0, scores, c0, out, 6, fp32); break;
        case 7: weigh_values8(it, values, nv, j0, scores, c0, out, 7, fp32); break;
        default: weigh_values8(it, values, nv, j0, scores, c0, out, 8, fp32); break;
        }
    }
}

/* fp32 is a constant at both call sites (attend_vec8), so the loads' offsets are too. */
static inline __attribute__((always_inline)) void attend_vec8_of(
    const Item *it, const float *q, float scale, float *scores, float *out, const int fp32) {
    int64_t len = visible(it, it->rows - 1);
    const char *keys[VALUES_PER_PASS];
    int nk = 0;
    FOR_EACH_KEY(it, it->key_cache, len, j, key, {
        keys[nk++] = key;
        if (nk == 8 || j + 1 == len) {
            for (int i = nk; i < 8; i++) keys[i] = keys[0]; /* padding, its scores unused */
            score_keys8(it, keys, nk, j + 1 - nk, q, scale, scores, fp32);
            nk = 0;
        }
    })
    prefetch_first(it, it->value_cache, first_walked(it), len); /* during the softmax */
    softmax_rows8(it, scores, len); /* zero past each row's own keys */
    for (int64_t i = 0; i < it->rows * it->head_dim; i++) out[i] = 0.0f;
    FOR_EACH_KEY(it, it->value_cache, len, j, value, {
        keys[nk++] = value;
        if (nk == VALUES_PER_PASS || j + 1 == len) {
            weigh_values_pass8(it, keys, nk, j + 1 - nk, scores, out, fp32);
            nk = 0;
        }
    })
}

static void attend_vec8(const Item *it, const float *q, float scale, float *scores,
                        float *out) {
    if (it->elem_bytes == 4)
        attend_vec8_of(it, q, scale, scores, out, 1);
    else
        attend_vec8_of(it, q, scale, scores, out, 0);
}

#if defined(__AVX512F__)
/* Row r's scores -> probabilities over its visible keys, zeros up to len (rounded to 16). */
static inline void softmax_row(const Item *it, float *scores, int64_t r, int64_t len) {
    float *sr = scores + r * it->stride;
    int64_t n = visible(it, r), lo = first_seen(it, r);
    prepare_row(it, sr, lo, n);
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t j = lo; j < n; j += 16)
        vmax = _mm512_mask_max_ps(vmax, tail_mask(n - j), vmax, _mm512_maskz_loadu_ps(tail_mask(n - j), sr + j));
    __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(vmax)), vsum = _mm512_setzero_ps();
    for (int64_t j = lo; j < n; j += 16) {
        __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail_mask(n - j), sr + j), shift));
        p = _mm512_maskz_mov_ps(tail_mask(n - j), p);
        _mm512_mask_storeu_ps(sr + j, tail_mask(n - j), p);
        vsum = _mm512_add_ps(vsum, p);
    }
    float sum = _mm512_reduce_add_ps(vsum);
    keep_stats(it, r, _mm512_cvtss_f32(shift), sum);
    __m512 inv = _mm512_set1_ps(1.0f / sum);
    for (int64_t j = lo; j < n; j += 16)
        _mm512_mask_storeu_ps(sr + j, tail_mask(n - j),
                              _mm512_mul_ps(_mm512_maskz_loadu_ps(tail_mask(n - j), sr + j), inv));
    for (int64_t j = n; j < len; j++) sr[j] = 0.0f; /* keys past this row's position weigh 0 */
}

static void attend_avx512(const Item *it, const float *q, float scale, float *scores,
                          float *out) {
    int64_t d = it->head_dim, chunks = (d + 15) / 16, rows = it->rows;
    int64_t len = visible(it, rows - 1);
    __m512 kv[MAX_HEAD_DIM / 16];
    FOR_EACH_KEY(it, it->key_cache, len, j, key, {
        for (int64_t c = 0; c < chunks; c++)
            kv[c] = load_bf16((const uint16_t *)key + 16 * c, tail_mask(d - 16 * c));
        for (int64_t r = 0; r < rows; r++) {
            __m512 dot = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; c++)
                dot = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail_mask(d - 16 * c), q + r * d + 16 * c),
                                      kv[c], dot);
            scores[r * it->stride + j] = _mm512_reduce_add_ps(dot) * scale;
        }
    })
    prefetch_first(it, it->value_cache, first_walked(it), len); /* during the softmax */
    for (int64_t r = 0; r < rows; r++) {
        softmax_row(it, scores, r, len);
        for (int64_t c = 0; c < d; c++) out[r * d + c] = 0.0f;
    }
    FOR_EACH_KEY(it, it->value_cache, len, j, value, {
        for (int64_t c = 0; c < chunks; c++)
            kv[c] = load_bf16((const uint16_t *)value + 16 * c, tail_mask(d - 16 * c));
        for (int64_t r = 0; r < rows; r++) {
            __m512 p = _mm512_set1_ps(scores[r * it->stride + j]);
            for (int64_t c = 0; c < chunks; c++) {
                float *o = out + r * d + 16 * c;
                _mm512_mask_storeu_ps(o, tail_mask(d - 16 * c),
                                      _mm512_fmadd_ps(p, kv[c], _mm512_maskz_loadu_ps(tail_mask(d - 16 * c), o)));
            }
        }
    })
}

/* Two keys' dot-product vectors a, b as one: in each 128-bit lane, (a0 + a2, b0 + b2, a1 + a3,
 * b1 + b3). */
static inline __m512 fold_pair(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

/* Two folded pairs (keys 0, 1 and 2, 3) as the four keys' sums over all 16 lanes: each key's
 * lanes summed in one order whatever its neighbours. */
static inline __m128 fold_quad(__m512 pair01, __m512 pair23) {
    __m512 four = _mm512_add_ps(_mm512_shuffle_ps(pair01, pair23, 0x44),
                                _mm512_shuffle_ps(pair01, pair23, 0xEE));
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(four), _mm512_extractf32x8_ps(four, 1));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

/* The first n (1 to 4) of four keys' sums, times scale, as their scores. */
static inline void store_four(float *at, __m128 sums, float scale, int n) {
    _mm_mask_storeu_ps(at, (__mmask8)((1u << n) - 1u), _mm_mul_ps(sums, _mm_set1_ps(scale)));
}

/* head_dim = 16 * ch (64 or 128, most models): rows in blocks of nr <= 4 (2 for 128) whose
 * queries and accumulators stay in registers while each key or value is loaded once.
 * ch and nr are constants at every call site (see attend_avx512_fixed). */
static inline __attribute__((always_inline)) void fixed_block(
    const Item *it, const float *q, float scale, float *scores, float *out, int64_t r0,
    const int nr, const int ch) {
    int64_t len = visible(it, r0 + nr - 1);
    __m512 reg[4][8];
    for (int t = 0; t < nr; t++)
        for (int c = 0; c < ch; c++) reg[t][c] = _mm512_loadu_ps(q + (r0 + t) * 16 * ch + 16 * c);
    /* Each row's dot products are summed across lanes four keys at a time (keys 4i .. 4i + 3
     * by position, so a score's bits do not depend on the batch): kept is key 4i's (then the
     * pair 4i, 4i + 1 folded into one vector), odd is key 4i + 2's. The walk starts at a
     * multiple of four (a block's start, block sizes of whole fours), so every group but the
     * last is whole. */
    __m512 kept[4], odd[4];
    FOR_EACH_KEY(it, it->key_cache, len, j, key, {
        __m512 k[8];
        for (int c = 0; c < ch; c++) k[c] = load_bf16((const uint16_t *)key + 16 * c, 0xffff);
        for (int t = 0; t < nr; t++) {
            __m512 dot = _mm512_mul_ps(reg[t][0], k[0]);
            for (int c = 1; c < ch; c++) dot = _mm512_fmadd_ps(reg[t][c], k[c], dot);
            switch (j & 3) {
            case 0: kept[t] = dot; break;
            case 1: kept[t] = fold_pair(kept[t], dot); break;
            case 2: odd[t] = dot; break;
            default:
                store_four(scores + (r0 + t) * it->stride + j - 3,
                           fold_quad(kept[t], fold_pair(odd[t], dot)), scale, 4);
            }
        }
    })
    const int64_t done = len & ~(int64_t)3; /* keys with their scores stored */
    if (len > done) { /* the last one to three keys, beside zeros */
        const __m512 zero = _mm512_setzero_ps();
        for (int t = 0; t < nr; t++) {
            __m512 low = len - done == 1 ? fold_pair(kept[t], zero) : kept[t];
            __m512 high = len - done == 3 ? fold_pair(odd[t], zero) : zero;
            store_four(scores + (r0 + t) * it->stride + done, fold_quad(low, high), scale,
                       (int)(len - done));
        }
    }
    prefetch_first(it, it->value_cache, first_walked(it), len); /* during the softmax */
    for (int t = 0; t < nr; t++) softmax_row(it, scores, r0 + t, len);
    for (int t = 0; t < nr; t++)
        for (int c = 0; c < ch; c++) reg[t][c] = _mm512_setzero_ps();
    FOR_EACH_KEY(it, it->value_cache, len, j, value, {
        __m512 v[8];
        for (int c = 0; c < ch; c++) v[c] = load_bf16((const uint16_t *)value + 16 * c, 0xffff);
        for (int t = 0; t < nr; t++) {
            __m512 p = _mm512_set1_ps(scores[(r0 + t) * it->stride + j]);
            for (int c = 0; c < ch; c++) reg[t][c] = _mm512_fmadd_ps(p, v[c], reg[t][c]);
        }
    })
    for (int t = 0; t < nr; t++)
        for (int c = 0; c < ch; c++) _mm512_storeu_ps(out + (r0 + t) * 16 * ch + 16 * c, reg[t][c]);
}

/* 1 when head_dim has a register-blocked path (then it ran). */
static int attend_avx512_fixed(const Item *it, const float *q, float scale, float *scores,
                               float *out) {
    if ((it->head_dim != 64 && it->head_dim != 128) || it->block_size % 4) return 0;
    int block = it->head_dim == 64 ? 4 : 2;
    for (int64_t r0 = 0; r0 < it->rows; r0 += block) {
        int64_t nr = it->rows - r0 < block ? it->rows - r0 : block;
#define FIXED(n, c) fixed_block(it, q, scale, scores, out, r0, n, c)
        if (it->head_dim == 64) {
            switch (nr) {
            case 1: FIXED(1, 4); break; case 2: FIXED(2, 4); break;
            case 3: FIXED(3, 4); break; default: FIXED(4, 4); break;
            }
        } else if (nr == 1) {
            FIXED(1, 8);
        } else {
            FIXED(2, 8);
        }
#undef FIXED
    }
    return 1;
}
#endif

int sb_attention_has_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* A sequence's chunk of queries, and the parts of its keys: part p holds keys
 * [p SPLIT_KEYS, (p + 1) SPLIT_KEYS). A long context's parts are work items of their own, so
 * that both cores share a lone sequence's KV heads (three for the default model, where one
 * core would take two), each part's rows normalized over its keys and merged after: the
 * parts depend on positions only, so a row's result does not depend on the batch around it. */
#ifndef SPLIT_KEYS
#define SPLIT_KEYS 1024
#endif

typedef struct {
    int64_t seq, first, queries; /* queries first .. first + queries - 1 of the sequence */
    int64_t part0, part_end;     /* the parts its rows see */
    int64_t partial;             /* where its parts' rows start in the partials; -1: one part */
} Chunk;

/* Rows [rows, head_dim] fp32 to out's rows row0 + r / group, heads g * group + r % group. */
static void store_rows(void *out, int64_t out_row, int64_t out_head, int64_t row0, int64_t g,
                       int64_t group, int64_t rows, int64_t head_dim, int fp32, const float *of) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t at = (row0 + r / group) * out_row + (g * group + r % group) * out_head;
        for (int64_t c = 0; c < head_dim; c++) {
            if (fp32)
                ((float *)out)[at + c] = of[r * head_dim + c];
            else
                ((uint16_t *)out)[at + c] = f32_to_bf16(of[r * head_dim + c]);
        }
    }
}

/* out[r] = sum over parts p of w_p o_p[r], w_p = l_p e^(m_p - M) / sum of those, M the largest
 * m_p: the parts' rows o [parts, rows, head_dim], each normalized over its own keys, and
 * stats [parts, rows, 2] (m_p, l_p); a part with no keys for a row (-inf, 0) weighs 0. */
static void merge_parts(const float *o, const float *stats, int64_t parts, int64_t rows,
                        int64_t head_dim, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float most = -INFINITY, total = 0.0f;
        for (int64_t p = 0; p < parts; p++) {
            float m = stats[2 * (p * rows + r)];
            most = m > most ? m : most;
        }
        for (int64_t p = 0; p < parts; p++) {
            const float *st = stats + 2 * (p * rows + r);
            total += st[1] > 0.0f ? st[1] * expf(st[0] - most) : 0.0f;
        }
        for (int64_t c = 0; c < head_dim; c++) out[r * head_dim + c] = 0.0f;
        for (int64_t p = 0; p < parts; p++) {
            const float *st = stats + 2 * (p * rows + r);
            if (!(st[1] > 0.0f)) continue;
            float weight = st[1] * expf(st[0] - most) / total;
            for (int64_t c = 0; c < head_dim; c++)
                out[r * head_dim + c] += weight * o[(p * rows + r) * head_dim + c];
        }
    }
}

/* Semantics, for each sequence s and query i < seq_queries[s] at row r = seq_row[s] + i,
 * each head h (KV head g = h / (heads / kv_heads)), len = seq_start[s] + i + 1:
 *     out[r, h] = softmax(scale * q[r, h] . K_s[:len, g]) . V_s[:len, g]
 * where K_s[j] is key_cache[tables[seq_table[s] + j / block_size], j % block_size], except
 * that where own_slots[s] >= 0 (then seq_queries[s] is 1) K_s[seq_start[s]] is the flat slot
 * own_slots[s] of the cache (same for V).
 *   q, out: [T, heads, head_dim] with the given row and head strides (elements)
 *   key_cache, value_cache: [num_blocks, block_size, kv_heads, head_dim], contiguous
 *   all four bf16 (fp32 = 0) or all fp32 (fp32 = 1)
 * Returns 0, or -1 if head_dim > MAX_HEAD_DIM (nothing written) or scratch memory ran out
 * (output incomplete).
 */
int sb_paged_decode_windowed(const void *q, int64_t q_row, int64_t q_head, void *out,
                             int64_t out_row, int64_t out_head, const void *key_cache,
                             const void *value_cache, int64_t block_size, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, int64_t n_seqs,
                             const int64_t *seq_row, const int64_t *seq_queries,
                             const int64_t *seq_start, const int64_t *seq_table,
                             const int64_t *tables, const int64_t *own_slots, float scale,
                             int fp32, int portable, int64_t window, float softcap) {
    if (head_dim > MAX_HEAD_DIM) return -1;
    int use_avx512 = sb_attention_has_avx512() && !portable && !fp32;
    int vec8 = !use_avx512 && !portable && head_dim % 8 == 0;
    int64_t elem_bytes = fp32 ? 4 : 2;
    int64_t group = heads / kv_heads, most_keys = 0, units = 0, chunks = 0, failed = 0;
    /* A sequence verifying drafts feeds up to k + 1 queries: its queries are split into
     * chunks of CHUNK_QUERIES, each its own work item, so that both threads share one
     * sequence's verification instead of one taking its KV heads two at a time. A chunk
     * whose keys span several parts of SPLIT_KEYS is an item per part (see Chunk). */
    for (int64_t s = 0; s < n_seqs; s++) {
        int64_t keys = seq_start[s] + seq_queries[s];
        most_keys = keys > most_keys ? keys : most_keys;
        chunks += (seq_queries[s] + CHUNK_QUERIES - 1) / CHUNK_QUERIES;
    }
    Chunk *chunk = malloc(sizeof(Chunk) * (chunks ? chunks : 1));
    if (!chunk) return -1;
    int64_t split_rows = 0; /* rows of all split chunks' KV heads, parts counted apart */
    for (int64_t s = 0, k = 0; s < n_seqs; s++)
        for (int64_t first = 0; first < seq_queries[s]; first += CHUNK_QUERIES, k++) {
            int64_t n = seq_queries[s] - first;
            n = n < CHUNK_QUERIES ? n : CHUNK_QUERIES;
            int64_t hi = seq_start[s] + first + n, lo = window > 0 ? hi - n + 1 - window : 0;
            Chunk ch = {s, first, n, (lo > 0 ? lo : 0) / SPLIT_KEYS, (hi - 1) / SPLIT_KEYS + 1, -1};
            if (ch.part_end - ch.part0 > 1) {
                ch.partial = split_rows;
                split_rows += kv_heads * (ch.part_end - ch.part0) * group * n;
            }
            units += ch.part_end - ch.part0;
            chunk[k] = ch;
        }
    /* A KV head's rows of a token are a third (the default model) of the token's row in the
     * cache, so a walk over one KV head reads 256 of every 768 bytes (fp32) and, on a 2-core
     * Zen 3, no read in that pattern passed ~10 GB/s where whole blocks read at ~20
     * (bench/decode_attention.py). Where the 8-wide loops run and the (chunk, part) units fill
     * the threads twice over, an item therefore walks every KV head of its tokens; with fewer
     * units (a lone short sequence) each KV head stays an item, so both cores share them.
     * Each row is computed alike either way (the same keys, grouped alike, in the same order). */
    int threads = 1;
#if defined(_OPENMP)
    threads = omp_get_max_threads();
#endif
    int64_t walked = vec8 && units >= 2 * threads ? kv_heads : 1; /* KV heads an item walks */
    int64_t items = units * (kv_heads / walked);
    int64_t most_rows = group * CHUNK_QUERIES * walked, padded = (most_keys + 15) / 16 * 16;
    int64_t *work = malloc(sizeof(int64_t) * 3 * (items ? items : 1)); /* (chunk, g, part) */
    float *partials = malloc(sizeof(float) * (split_rows * (head_dim + 2) + 1));
    if (!work || !partials) {
        free(chunk), free(work), free(partials);
        return -1;
    }
    for (int64_t k = 0, w = 0; k < chunks; k++) /* a part's KV heads together: they share lines */
        for (int64_t part = chunk[k].part0; part < chunk[k].part_end; part++)
            for (int64_t g = 0; g < kv_heads; g += walked, w++) {
                work[3 * w] = k;
                work[3 * w + 1] = g;
                work[3 * w + 2] = part;
            }
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * most_rows * padded);
        float *qf = malloc(sizeof(float) * most_rows * head_dim);
        float *of = malloc(sizeof(float) * most_rows * head_dim);
        float *stats = malloc(sizeof(float) * most_rows * 2);
        if (!scores || !qf || !of || !stats) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < items; w++) {
            if (failed) continue;
            const Chunk *ch = &chunk[work[3 * w]];
            int64_t s = ch->seq, g = work[3 * w + 1], part = work[3 * w + 2], n = ch->queries;
            int64_t row0 = seq_row[s] + ch->first; /* the chunk's first query row */
            const int64_t head_rows = group * n;
            Item it = {key_cache, value_cache, elem_bytes, block_size, kv_heads, head_dim,
                       tables + seq_table[s], g, walked, walked * head_rows, group, head_rows,
                       seq_start[s] + ch->first + 1, (seq_start[s] + ch->first + n + 15) / 16 * 16,
                       own_slots[s] >= 0 ? seq_start[s] : -1, own_slots[s], window, softcap,
                       part * SPLIT_KEYS, (part + 1) * SPLIT_KEYS,
                       ch->partial >= 0 ? stats : NULL};
            /* row r of the item: query row0 + i (i = query_of(r)), head (g + r / head_rows) *
             * group + r % group */
            for (int64_t r = 0; r < it.rows; r++) {
                int64_t h = (g + r / head_rows) * group + r % group;
                int64_t at = (row0 + query_of(&it, r)) * q_row + h * q_head;
                for (int64_t c = 0; c < head_dim; c++)
                    qf[r * head_dim + c] = fp32 ? ((const float *)q)[at + c]
                                                : bf16_to_f32(((const uint16_t *)q)[at + c]);
            }
#if defined(__AVX512F__)
            if (use_avx512) {
                if (!attend_avx512_fixed(&it, qf, scale, scores, of))
                    attend_avx512(&it, qf, scale, scores, of);
            } else
#endif
            if (vec8)
                attend_vec8(&it, qf, scale, scores, of);
            else
                attend_portable(&it, qf, scale, scores, of);
            for (int64_t k = 0; k < walked; k++) {
                const float *rows_k = of + k * head_rows * head_dim;
                if (ch->partial < 0) {
                    store_rows(out, out_row, out_head, row0, g + k, group, head_rows, head_dim,
                               fp32, rows_k);
                    continue;
                }
                /* this part's rows and stats, beside the chunk's other parts' */
                int64_t parts = ch->part_end - ch->part0;
                int64_t at = ch->partial + ((g + k) * parts + part - ch->part0) * head_rows;
                memcpy(partials + at * head_dim, rows_k, sizeof(float) * head_rows * head_dim);
                memcpy(partials + split_rows * head_dim + 2 * at, stats + 2 * k * head_rows,
                       sizeof(float) * 2 * head_rows);
            }
        }
        /* the implicit barrier: every part is done */
#pragma omp for schedule(static)
        for (int64_t w = 0; w < items; w++) {
            const Chunk *ch = &chunk[work[3 * w]];
            if (failed || ch->partial < 0 || work[3 * w + 2] != ch->part0) continue;
            int64_t rows = group * ch->queries;
            for (int64_t g = work[3 * w + 1]; g < work[3 * w + 1] + walked; g++) {
                int64_t at = ch->partial + g * (ch->part_end - ch->part0) * rows;
                merge_parts(partials + at * head_dim, partials + split_rows * head_dim + 2 * at,
                            ch->part_end - ch->part0, rows, head_dim, of);
                store_rows(out, out_row, out_head, seq_row[ch->seq] + ch->first, g, group, rows,
                           head_dim, fp32, of);
            }
        }
        free(scores);
        free(stats);
        free(qf);
        free(of);
    }
    free(chunk);
    free(work);
    free(partials);
    return failed ? -1 : 0;
}

/* sb_paged_decode_windowed without a window or soft-cap (the Llama block; draft_cpu.c). */
int sb_paged_decode(const void *q, int64_t q_row, int64_t q_head, void *out, int64_t out_row,
                    int64_t out_head, const void *key_cache, const void *value_cache,
                    int64_t block_size, int64_t heads, int64_t kv_heads, int64_t head_dim,
                    int64_t n_seqs, const int64_t *seq_row, const int64_t *seq_queries,
                    const int64_t *seq_start, const int64_t *seq_table, const int64_t *tables,
                    const int64_t *own_slots, float scale, int fp32, int portable) {
    return sb_paged_decode_windowed(q, q_row, q_head, out, out_row, out_head, key_cache,
                                    value_cache, block_size, heads, kv_heads, head_dim, n_seqs,
                                    seq_row, seq_queries, seq_start, seq_table, tables, own_slots,
                                    scale, fp32, portable, 0, 0.0f);
}
