/* Forbidding tokens in place: a packed bitmask of allowed tokens applied to fp32 logits.
 *
 * Why native code: constrained decoding masks every constrained row of a step; in torch
 * that is an unpack of the bits to a bool tensor, a gather, a masked_fill and a scatter,
 * 7 ms a step for 32 rows of a 49,152-token vocabulary (most of what constraining cost at
 * batch 32, docs/structured-outputs.md). Here each row is one pass of masked stores.
 * Built by switchboard_kernels/native.py; tests check it against a per-token loop.
 */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Semantics: for i < rows and token t < vocab, logits[row_index[i] * logits_stride + t]
 * becomes -inf unless bit t % 32 of bitmask[i * ceil(vocab / 32) + t / 32] is set.
 *   logits: fp32 rows, a row stride in elements; bitmask: int32 words, rows contiguous
 *   (llguidance's and xgrammar's layout). */
void sb_apply_token_bitmask_f32(float *logits, int64_t logits_stride, const int64_t *row_index,
                                const int32_t *bitmask, int64_t rows, int64_t vocab) {
    const int64_t words = (vocab + 31) / 32;
#pragma omp parallel for schedule(static) if (rows * vocab >= (1 << 20))
    for (int64_t i = 0; i < rows; i++) {
        float *row = logits + row_index[i] * logits_stride;
        const uint32_t *allowed = (const uint32_t *)bitmask + i * words;
        for (int64_t w = 0; w < words; w++) {
            const int64_t base = w * 32, left = vocab - base;
            const uint32_t in_vocab = left >= 32 ? UINT32_MAX : ((1u << left) - 1u);
            uint32_t forbidden = ~allowed[w] & in_vocab;
            if (forbidden == 0) continue;
#if defined(__AVX512F__)
            const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
            /* Masked-off lanes are neither written nor read: no access past the vocab. */
            _mm512_mask_storeu_ps(row + base, (__mmask16)(forbidden & 0xFFFFu), minus_inf);
            _mm512_mask_storeu_ps(row + base + 16, (__mmask16)(forbidden >> 16), minus_inf);
#else
            for (; forbidden != 0; forbidden &= forbidden - 1u)
                row[base + __builtin_ctz(forbidden)] = -INFINITY;
#endif
        }
    }
}
