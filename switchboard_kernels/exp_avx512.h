/* e^x for x <= 0 on 16 fp32 lanes, for the native CPU kernels' softmaxes and activations
 * (attention_cpu.c, activation_cpu.c): x = n ln2 + f ln2 with |f| <= 1/2, 2^f by its degree-6
 * Taylor polynomial (relative error < 2e-7), then scaled by 2^n; subnormal results are kept
 * and x below -104 gives 0. */
#ifndef SWITCHBOARD_EXP_AVX512_H
#define SWITCHBOARD_EXP_AVX512_H

#if defined(__AVX512F__)
#include <immintrin.h>

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
#endif

#endif
