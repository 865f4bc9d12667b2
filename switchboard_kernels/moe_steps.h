/* The grouped experts of a sparse MoE layer in one native call, for either dtype: included by
 * moe_bf16_cpu.c and moe_f32_cpu.c, which first define
 *   MOE_T (the rows' element type), MOE_W (an expert projection's panel descriptor),
 *   MOE_NAME (the exported function), moe_panels(w) (panels of a projection),
 *   moe_panel(w, p, x, rows, y, next_w, next_p) (rows times panel p of w, into y),
 *   moe_silu_row(gate, up, y, dim) and moe_add(o, y, weight) (o = o + y * weight, rounded as
 *   torch rounds the scaled product and the sum).
 *
 * Why one call: the same step in torch is ~15 small ops per layer (a sort, a bincount, a gather,
 * per expert two products, a chunk, the activation, the scaling, then a scatter), each with
 * Python's and a thread team's start-up; at batch 1 they cost more than the weights' bytes of a
 * small expert (bench/moe.py). Here the (token, expert) pairs are grouped by a counting sort,
 * every active expert's panels run in one parallel loop (one expert's weights read once for all
 * its rows, the experts split among the threads), and the pairs are added back per token in
 * expert order, as the torch path (worker/model/moe.py) and transformers add them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MOE_MAX_TOP_K 64

static void *moe_alloc(int64_t bytes) {
    size_t size = (size_t)((bytes + 63) / 64 * 64);
    return aligned_alloc(64, size ? size : 64);
}

/* Semantics: out[t] = sum over j < top_k, in ascending expert order, of
 *   weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = experts[t, j],
 * where gate_up[e] holds gate_e then up_e (out_features 2 I) and down[e] maps I back to the
 * hidden size. x, out [tokens, hidden]; experts int64 and weights fp32 [tokens, top_k].
 * Returns 0, 1 for an expert id out of range or top_k out of [1, 64], 2 when out of memory. */
int MOE_NAME(const MOE_W *const *gate_up, const MOE_W *const *down, int64_t num_experts,
             const MOE_T *x, int64_t tokens, const int64_t *experts, const float *weights,
             int64_t top_k, MOE_T *out) {
    if (top_k < 1 || top_k > MOE_MAX_TOP_K) return 1;
    const int64_t pairs = tokens * top_k;
    for (int64_t q = 0; q < pairs; q++)
        if (experts[q] < 0 || experts[q] >= num_experts) return 1;
    if (tokens <= 0) return 0;
    const int64_t H = gate_up[0]->in_features, I2 = gate_up[0]->out_features, I = I2 / 2;
    int64_t *offset = calloc((size_t)num_experts + 1, sizeof *offset);
    int64_t *fill = calloc((size_t)num_experts, sizeof *fill);
    int64_t *active = malloc((size_t)num_experts * sizeof *active);
    int64_t *token_of = malloc((size_t)pairs * sizeof *token_of);
    int64_t *slot = malloc((size_t)pairs * sizeof *slot);
    MOE_T *xs = moe_alloc(pairs * H * (int64_t)sizeof(MOE_T));
    MOE_T *gu = moe_alloc(pairs * I2 * (int64_t)sizeof(MOE_T));
    MOE_T *act = moe_alloc(pairs * I * (int64_t)sizeof(MOE_T));
    MOE_T *ys = moe_alloc(pairs * H * (int64_t)sizeof(MOE_T));
    int status = 0;
    if (!offset || !fill || !active || !token_of || !slot || !xs || !gu || !act || !ys) {
        status = 2;
        goto done;
    }
    /* Counting sort of the pairs by expert, tokens ascending within an expert (the torch
     * path's stable argsort of t * top_k + j). */
    for (int64_t q = 0; q < pairs; q++) offset[experts[q] + 1]++;
    int64_t num_active = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        if (offset[e + 1]) active[num_active++] = e;
        offset[e + 1] += offset[e];
    }
    for (int64_t q = 0; q < pairs; q++) {
        int64_t e = experts[q], s = offset[e] + fill[e]++;
        slot[q] = s;
        token_of[s] = q / top_k;
    }
    const int64_t gu_panels = moe_panels(gate_up[0]), dn_panels = moe_panels(down[0]);
    const int64_t gu_items = num_active * gu_panels, dn_items = num_active * dn_panels;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t s = 0; s < pairs; s++)
            memcpy(xs + s * H, x + token_of[s] * H, (size_t)H * sizeof(MOE_T));
        /* every active expert's gate_up panels, in expert order: consecutive items of a
         * thread are consecutive panels (one stream of weights) */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < gu_items; i++) {
            int64_t e = active[i / gu_panels], n = i + 1 < gu_items ? active[(i + 1) / gu_panels] : e;
            moe_panel(gate_up[e], i % gu_panels, xs + offset[e] * H, offset[e + 1] - offset[e],
                      gu + offset[e] * I2, i + 1 < gu_items ? gate_up[n] : NULL,
                      (i + 1) % gu_panels);
        }
#pragma omp for schedule(static)
        for (int64_t s = 0; s < pairs; s++) moe_silu_row(gu + s * I2, gu + s * I2 + I, act + s * I, I);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < dn_items; i++) {
            int64_t e = active[i / dn_panels], n = i + 1 < dn_items ? active[(i + 1) / dn_panels] : e;
            moe_panel(down[e], i % dn_panels, act + offset[e] * I, offset[e + 1] - offset[e],
                      ys + offset[e] * H, i + 1 < dn_items ? down[n] : NULL, (i + 1) % dn_panels);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) {
            int64_t order[MOE_MAX_TOP_K]; /* the token's j, by expert (stable) */
            for (int64_t j = 0; j < top_k; j++) {
                int64_t at = j;
                while (at > 0 && experts[t * top_k + order[at - 1]] > experts[t * top_k + j]) {
                    order[at] = order[at - 1];
                    at--;
                }
                order[at] = j;
            }
            MOE_T *o = out + t * H;
            memset(o, 0, (size_t)H * sizeof(MOE_T));
            for (int64_t j = 0; j < top_k; j++) {
                int64_t q = t * top_k + order[j];
                const MOE_T *y = ys + slot[q] * H;
                float w = weights[q];
                for (int64_t c = 0; c < H; c++) moe_add(o + c, y[c], w);
            }
        }
    }
done:
    free(offset);
    free(fill);
    free(active);
    free(token_of);
    free(slot);
    free(xs);
    free(gu);
    free(act);
    free(ys);
    return status;
}
