/* Decode attention straight from the paged KV cache on CPU, bf16 (PagedAttention, Kwon et
 * al., SOSP 2023): each decoding sequence's queries against its own blocks, read in place.
 *
 * Why native code: the torch path gathers each sequence's blocks into a padded copy, then
 * runs SDPA with a mask over the padding, so K and V cross memory three times and short
 * sequences pay for long ones; here each key and value is read once, where it lies, and
 * only up to each query's own position. Built by kernels/native.py (-march=native); the
 * portable loops are compiled always and tests check both against the torch reference.
 *
 * Cache layout (kernels/paged_attention.py): [num_blocks, block_size, kv_heads, head_dim].
 * Query head h reads KV head h / (heads / kv_heads) (grouped-query attention). A sequence
 * feeds n queries (1, or k + 1 when a speculative step verifies k drafts); query i sits at
 * position start + i and sees keys 0 .. start + i.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_HEAD_DIM 256

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

typedef struct {
    const uint16_t *key_cache, *value_cache;
    int64_t block_size, kv_heads, head_dim;
    const int64_t *table; /* this sequence's blocks */
    int64_t kv_head;
} Keys;

static inline const uint16_t *key_at(const Keys *k, const uint16_t *cache, int64_t j) {
    int64_t slot = k->table[j / k->block_size] * k->block_size + j % k->block_size;
    return cache + (slot * k->kv_heads + k->kv_head) * k->head_dim;
}

/* One query row: softmax(scale * q . K[:len]) . V[:len] into out (fp32, head_dim). */
static void attend_portable(const Keys *k, const float *q, int64_t len, float scale,
                            float *scores, float *out) {
    int64_t d = k->head_dim;
    float max = -INFINITY, sum = 0.0f;
    for (int64_t j = 0; j < len; j++) {
        const uint16_t *key = key_at(k, k->key_cache, j);
        float s = 0.0f;
        for (int64_t c = 0; c < d; c++) s += q[c] * bf16_to_f32(key[c]);
        scores[j] = s * scale;
        if (scores[j] > max) max = scores[j];
    }
    for (int64_t j = 0; j < len; j++) {
        scores[j] = expf(scores[j] - max);
        sum += scores[j];
    }
    for (int64_t c = 0; c < d; c++) out[c] = 0.0f;
    for (int64_t j = 0; j < len; j++) {
        const uint16_t *value = key_at(k, k->value_cache, j);
        float p = scores[j] / sum;
        for (int64_t c = 0; c < d; c++) out[c] += p * bf16_to_f32(value[c]);
    }
}

#if defined(__AVX512F__)
static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) {
    __m256i raw = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* e^x for x <= 0: x = n ln2 + f ln2 with |f| <= 1/2, 2^f by its degree-6 Taylor polynomial
 * (relative error < 2e-7), then scaled by 2^n. Large negative x gives 0. */
static inline __m512 exp_nonpositive(__m512 x) {
    __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)),
                             _mm512_set1_ps(1.44269504089f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718056f));
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static void attend_avx512(const Keys *k, const float *q, int64_t len, float scale,
                          float *scores, float *out) {
    int64_t d = k->head_dim, chunks = (d + 15) / 16;
    __m512 qv[MAX_HEAD_DIM / 16], acc[MAX_HEAD_DIM / 16];
    for (int64_t c = 0; c < chunks; c++) {
        qv[c] = _mm512_maskz_loadu_ps(d - 16 * c >= 16 ? 0xffff : (1u << (d - 16 * c)) - 1,
                                      q + 16 * c);
        acc[c] = _mm512_setzero_ps();
    }
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < len; j++) {
        const uint16_t *key = key_at(k, k->key_cache, j);
        __m512 dot = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c++) {
            __mmask16 m = d - 16 * c >= 16 ? 0xffff : (1u << (d - 16 * c)) - 1;
            dot = _mm512_fmadd_ps(qv[c], load_bf16(key + 16 * c, m), dot);
        }
        scores[j] = _mm512_reduce_add_ps(dot) * scale;
    }
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(scores + j));
    float max = _mm512_reduce_max_ps(vmax);
    for (; j < len; j++) max = scores[j] > max ? scores[j] : max;
    __m512 vsum = _mm512_setzero_ps(), shift = _mm512_set1_ps(max);
    for (j = 0; j < len; j += 16) {
        __mmask16 m = len - j >= 16 ? 0xffff : (1u << (len - j)) - 1;
        __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + j), shift));
        p = _mm512_maskz_mov_ps(m, p);
        _mm512_mask_storeu_ps(scores + j, m, p);
        vsum = _mm512_add_ps(vsum, p);
    }
    float inv = 1.0f / _mm512_reduce_add_ps(vsum);
    for (j = 0; j < len; j++) {
        const uint16_t *value = key_at(k, k->value_cache, j);
        __m512 p = _mm512_set1_ps(scores[j]);
        for (int64_t c = 0; c < chunks; c++) {
            __mmask16 m = d - 16 * c >= 16 ? 0xffff : (1u << (d - 16 * c)) - 1;
            acc[c] = _mm512_fmadd_ps(p, load_bf16(value + 16 * c, m), acc[c]);
        }
    }
    for (int64_t c = 0; c < chunks; c++) {
        __mmask16 m = d - 16 * c >= 16 ? 0xffff : (1u << (d - 16 * c)) - 1;
        _mm512_mask_storeu_ps(out + 16 * c, m, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
    }
}
#endif

int sb_attention_has_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* Semantics, for each sequence s and query i < seq_queries[s] at row r = seq_row[s] + i,
 * each head h (KV head g = h / (heads / kv_heads)), len = seq_start[s] + i + 1:
 *     out[r, h] = softmax(scale * q[r, h] . K_s[:len, g]) . V_s[:len, g]
 * where K_s[j] is key_cache[tables[seq_table[s] + j / block_size], j % block_size].
 *   q, out: [T, heads, head_dim] bf16 with the given row and head strides (elements)
 *   key_cache, value_cache: [num_blocks, block_size, kv_heads, head_dim] bf16, contiguous
 * Returns 0, or -1 if head_dim > MAX_HEAD_DIM (nothing written) or scratch memory ran out
 * (output incomplete).
 */
int sb_paged_decode_bf16(const uint16_t *q, int64_t q_row, int64_t q_head, uint16_t *out,
                         int64_t out_row, int64_t out_head, const uint16_t *key_cache,
                         const uint16_t *value_cache, int64_t block_size, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t n_seqs,
                         const int64_t *seq_row, const int64_t *seq_queries,
                         const int64_t *seq_start, const int64_t *seq_table,
                         const int64_t *tables, float scale, int portable) {
    if (head_dim > MAX_HEAD_DIM) return -1;
    int use_avx512 = sb_attention_has_avx512() && !portable;
    int64_t group = heads / kv_heads, longest = 0, failed = 0;
    for (int64_t s = 0; s < n_seqs; s++)
        if (seq_start[s] + seq_queries[s] > longest) longest = seq_start[s] + seq_queries[s];
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (longest + 16));
        float qf[MAX_HEAD_DIM], of[MAX_HEAD_DIM];
        if (!scores) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < n_seqs * kv_heads; item++) {
            if (!scores) continue;
            int64_t s = item / kv_heads;
            Keys k = {key_cache, value_cache, block_size, kv_heads, head_dim,
                      tables + seq_table[s], item % kv_heads};
            for (int64_t i = 0; i < seq_queries[s]; i++) {
                for (int64_t h = k.kv_head * group; h < (k.kv_head + 1) * group; h++) {
                    const uint16_t *qh = q + (seq_row[s] + i) * q_row + h * q_head;
                    for (int64_t c = 0; c < head_dim; c++) qf[c] = bf16_to_f32(qh[c]);
                    int64_t len = seq_start[s] + i + 1;
#if defined(__AVX512F__)
                    if (use_avx512)
                        attend_avx512(&k, qf, len, scale, scores, of);
                    else
#endif
                        attend_portable(&k, qf, len, scale, scores, of);
                    uint16_t *oh = out + (seq_row[s] + i) * out_row + h * out_head;
                    for (int64_t c = 0; c < head_dim; c++) oh[c] = f32_to_bf16(of[c]);
                }
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
