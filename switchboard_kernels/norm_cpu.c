/* RMSNorm for bf16 or fp32 rows on CPU: out = x / sqrt(mean(x^2) + eps) * weight, fp32
 * inside, rounded to bf16 once.
 *
 * Why native code: in the engine, torch's CPU rms_norm on a few rows (a batch-1 decode)
 * costs its thread team's start-up rather than its bytes, and a step of the default model
 * calls it 61 times (docs/performance.md); rows here run on the calling thread until a
 * batch is large enough to share. Built by switchboard_kernels/native.py; tests check it against a
 * float64 RMSNorm.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* Semantics: out[r] = bf16(x[r] * rsqrt(mean(x[r]^2) + eps) * weight), r < rows.
 *   x, out: [rows, dim] bf16 with row strides (elements); weight: [dim] bf16. */
void sb_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *weight,
                      uint16_t *out, int64_t out_stride, int64_t rows, int64_t dim,
                      float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *yr = out + r * out_stride;
#if defined(__AVX512F__)
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < dim; c += 16) {
            __m512 v = load_bf16(xr + c, tail_mask(dim - c));
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps));
        for (int64_t c = 0; c < dim; c += 16) {
            __mmask16 m = tail_mask(dim - c);
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(load_bf16(xr + c, m), scale),
                                     load_bf16(weight + c, m));
            store_bf16(yr + c, v, m);
        }
#else
        float sum = 0.0f;
        for (int64_t c = 0; c < dim; c++) sum += bf16_to_f32(xr[c]) * bf16_to_f32(xr[c]);
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t c = 0; c < dim; c++)
            yr[c] = f32_to_bf16(bf16_to_f32(xr[c]) * inv * bf16_to_f32(weight[c]));
#endif
    }
}

/* Semantics: out[r] = bf16(x[r] * rsqrt(mean(x[r]^2) + eps) * weight), r < rows: a bf16 model's
 * norm over its fp32 residual stream (worker/model/llama.py), read unrounded.
 *   x: [rows, dim] fp32, out: [rows, dim] bf16, with row strides (elements); weight: [dim] bf16. */
void sb_rms_norm_f32_bf16(const float *x, int64_t x_stride, const uint16_t *weight,
                          uint16_t *out, int64_t out_stride, int64_t rows, int64_t dim,
                          float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        uint16_t *yr = out + r * out_stride;
#if defined(__AVX512F__)
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < dim; c += 16) {
            __m512 v = _mm512_maskz_loadu_ps(tail_mask(dim - c), xr + c);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps));
        for (int64_t c = 0; c < dim; c += 16) {
            __mmask16 m = tail_mask(dim - c);
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + c), scale),
                                     load_bf16(weight + c, m));
            store_bf16(yr + c, v, m);
        }
#else
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < dim; c++) sum += xr[c] * xr[c];
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t c = 0; c < dim; c++) yr[c] = f32_to_bf16(xr[c] * inv * bf16_to_f32(weight[c]));
#endif
    }
}

/* Semantics: out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * weight, as HF's LlamaRMSNorm
 * computes it in fp32 (the sum in another order).
 *   x, out: [rows, dim] fp32 with row strides (elements); weight: [dim] fp32. */
void sb_rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out,
                     int64_t out_stride, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *yr = out + r * out_stride, sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < dim; c++) sum += xr[c] * xr[c];
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
        for (int64_t c = 0; c < dim; c++) yr[c] = weight[c] * (xr[c] * inv);
    }
}
