/* SwiGLU's activation on CPU in one pass: out = silu(gate) * up over the two halves of the
 * gate_up projection's rows, bf16 or fp32.
 *
 * Why native code: torch runs it as two ops (silu into a new tensor, then the product into
 * another), each with its own pass over memory and its thread team's start-up; in a prefill
 * step of ~950 tokens on a 2-core AMX Xeon the two took ~40 ms of ~355 (torch's profiler),
 * more than all attention's softmaxes. Here each element is read once and written once.
 *
 * Rounding follows torch's bf16 ops exactly: silu(gate) in fp32, rounded to bf16, then the
 * product in fp32, rounded to bf16. e^x is a degree-6 polynomial after range reduction
 * (relative error < 2e-7, as attention_cpu.c's), so a bf16 result can differ from torch's
 * (Sleef, < 1 ulp) only where the fp32 value lies within ~2e-7 of a rounding boundary.
 * Built by switchboard_kernels/native.py (-march=native); the AVX-512 loop where the build has
 * AVX-512, the AVX2 one (8 lanes) where it has AVX2 and FMA (activation_native.py falls back
 * to torch elsewhere); the plain loop is compiled always, and tests check both against torch.
 */
#include "swiglu.h"

int sb_activation_has_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* 1 where a vector loop is built: AVX-512, or AVX2 with FMA. */
int sb_activation_has_vector_loop(void) {
#if defined(__AVX512F__) || defined(SWIGLU_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* Semantics: out[r, c] = bf16(bf16(silu(gate_up[r, c])) * gate_up[r, dim + c]), c < dim.
 *   gate_up: [rows, 2 * dim] bf16 with row stride in_stride; out: [rows, dim], out_stride.
 *   portable: the plain loop even where the AVX-512 one is built (tests). */
void sb_silu_mul_bf16(const uint16_t *gate_up, int64_t in_stride, uint16_t *out,
                      int64_t out_stride, int64_t rows, int64_t dim, int portable) {
#pragma omp parallel for schedule(static) if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * in_stride;
        silu_mul_row_bf16(gate, gate + dim, out + r * out_stride, dim, portable);
    }
}

/* Semantics: out[r, c] = silu(gate_up[r, c]) * gate_up[r, dim + c] in fp32. */
void sb_silu_mul_f32(const float *gate_up, int64_t in_stride, float *out, int64_t out_stride,
                     int64_t rows, int64_t dim, int portable) {
#pragma omp parallel for schedule(static) if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * in_stride;
        silu_mul_row_f32(gate, gate + dim, out + r * out_stride, dim, portable);
    }
}
