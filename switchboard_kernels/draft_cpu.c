/* A draft model's decode pass in one native call, on its 4-bit weights (q4.h).
 *
 * Why: a draft for speculative decoding runs a pass for every token it proposes, one token
 * per sequence, right after the target's step has evicted it from every cache. Through
 * torch, a 4-layer draft of the default model made ~120 op calls a pass (norms, rope, the
 * cache write, splits, silu, residual adds), each paying the dispatcher and its code's cache
 * misses: a pass took several times what reading its 4-bit weights takes
 * (docs/performance.md). Here the whole pass is one loop over layers with fp32
 * activations: RMSNorm, the fused qkv projection, RoPE (rotate-half), the K/V write into
 * the paged cache, decode attention (attention_cpu.c's kernel, passed in as a function
 * pointer so both share one implementation), the o projection added into the residual, the
 * MLP (SwiGLU) and the output layer.
 *
 * Each sequence feeds a few consecutive tokens (one, or the tokens the target accepted since
 * the draft's last pass); the runner sends anything else (long prefills, verification rows,
 * LoRA) through the model's torch path. Shapes and the weight layout are the model's
 * (switchboard_kernels/draft_native.py builds the descriptors).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_fn.h"
#include "q4.h"


struct sb_draft_layer {
    const float *input_norm, *post_norm; /* [hidden] */
    const struct sb_q4 *qkv, *o, *gate_up, *down;
};

struct sb_draft {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    int fp32;                       /* embeddings and KV caches fp32, else bf16 */
    const void *embed;              /* [vocab, hidden] */
    const float *final_norm;        /* [hidden] */
    const float *cos, *signed_sin;  /* [max_positions, head_dim]: rotate-half tables */
    const struct sb_draft_layer *layers;
    const struct sb_q4 *lm_head;    /* its output columns are the logits' */
    void *const *key_caches;        /* per layer [num_blocks, block_size, kv_heads, head_dim] */
    void *const *value_caches;
    AttentionFn attention;
};

static void rms_norm(const float *x, const float *w, int64_t rows, int64_t d, float eps,
                     float *y) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < d; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)d + eps);
#pragma omp simd
        for (int64_t i = 0; i < d; i++) y[r * d + i] = xr[i] * inv * w[i];
    }
}

/* Rotate-half RoPE of `count` heads of one row, in place. */
static void rope(float *x, int64_t count, int64_t hd, const float *cos, const float *ssin) {
    int64_t half = hd / 2;
    for (int64_t h = 0; h < count; h++, x += hd) {
        float rotated[hd];
        for (int64_t i = 0; i < hd; i++) rotated[i] = x[i < half ? i + half : i - half];
#pragma omp simd
        for (int64_t i = 0; i < hd; i++) x[i] = x[i] * cos[i] + rotated[i] * ssin[i];
    }
}

static void store(void *dst, const float *src, int64_t n, int fp32) {
    if (fp32) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
}

static void load(float *dst, const void *src, int64_t n, int fp32) {
    if (fp32) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
}

/* Semantics: the model's forward pass over `rows` tokens: row t feeds tokens[t] at
 * positions[t], its K/V written to flat cache slot slots[t]. Sequence s owns rows
 * seq_row[s] .. + seq_queries[s] (consecutive positions from seq_start[s]); query i of it
 * attends keys 0 .. seq_start[s] + i through its block table, tables[table_starts[s]:].
 * Then logits[o] = lm_head(final_norm(h[logit_rows[o]])) for o < num_logits, fp32.
 * Returns 0, -1 if scratch memory ran out, or the attention kernel's error. */
int sb_draft_decode(const struct sb_draft *m, int64_t rows, const int64_t *tokens,
                    const int64_t *positions, const int64_t *slots, int64_t n_seqs,
                    const int64_t *seq_row, const int64_t *seq_queries,
                    const int64_t *seq_start, const int64_t *table_starts,
                    const int64_t *tables, int64_t num_logits, const int64_t *logit_rows,
                    float *logits) {
    int64_t H = m->hidden, hd = m->head_dim, Q = m->heads * hd, KV = m->kv_heads * hd;
    int64_t I = m->intermediate, wide = I > Q ? I : Q, elem = m->fp32 ? 4 : 2;
    float *h = malloc(sizeof(float) * rows * H);
    float *x = malloc(sizeof(float) * rows * (wide > H ? wide : H));
    float *qkv = malloc(sizeof(float) * rows * (Q + 2 * KV));
    float *gu = malloc(sizeof(float) * rows * 2 * I);
    char *qa = malloc(elem * rows * Q), *oa = malloc(elem * rows * Q);
    int64_t *own = malloc(sizeof(int64_t) * n_seqs);
    Q4Rows xh = {0}, xq = {0}, xi = {0};
    int status = -1;
    if (!h || !x || !qkv || !gu || !qa || !oa || !own || q4_rows_alloc(&xh, rows, H) ||
        q4_rows_alloc(&xq, rows, Q) || q4_rows_alloc(&xi, rows, I))
        goto done;
    for (int64_t s = 0; s < n_seqs; s++) own[s] = -1;
    PanelFn panel = q4_pick(0);
    for (int64_t r = 0; r < rows; r++)
        load(h + r * H, (const char *)m->embed + tokens[r] * H * elem, H, m->fp32);
    status = 0;
    for (int64_t l = 0; l < m->num_layers && !status; l++) {
        const struct sb_draft_layer *L = m->layers + l;
        rms_norm(h, L->input_norm, rows, H, m->eps, x);
        q4_quantize_rows(x, 1, rows, &xh);
        q4_project(L->qkv, &xh, rows, NULL, qkv, 1, panel);
        for (int64_t r = 0; r < rows; r++) {
            float *row = qkv + r * (Q + 2 * KV); /* [q heads | k heads | v heads] */
            const float *c = m->cos + positions[r] * hd, *s = m->signed_sin + positions[r] * hd;
            rope(row, m->heads + m->kv_heads, hd, c, s);
            int64_t at = slots[r] * KV * elem;
            store((char *)m->key_caches[l] + at, row + Q, KV, m->fp32);
            store((char *)m->value_caches[l] + at, row + Q + KV, KV, m->fp32);
            store(qa + r * Q * elem, row, Q, m->fp32);
        }
        status = m->attention(qa, Q, hd, oa, Q, hd, m->key_caches[l], m->value_caches[l],
                              m->block_size, m->heads, m->kv_heads, hd, n_seqs, seq_row,
                              seq_queries, seq_start, table_starts, tables, own, m->scale,
                              m->fp32, 0);
        load(x, oa, rows * Q, m->fp32);
        q4_quantize_rows(x, 1, rows, &xq);
        q4_project(L->o, &xq, rows, h, h, 1, panel); /* h += o(attention) */
        rms_norm(h, L->post_norm, rows, H, m->eps, x);
        q4_quantize_rows(x, 1, rows, &xh);
        q4_project(L->gate_up, &xh, rows, NULL, gu, 1, panel);
        for (int64_t r = 0; r < rows; r++) {
            const float *g = gu + r * 2 * I, *u = g + I;
            float *a = x + r * I;
            for (int64_t i = 0; i < I; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        q4_quantize_rows(x, 1, rows, &xi);
        q4_project(L->down, &xi, rows, h, h, 1, panel); /* h += down(silu(gate) * up) */
    }
    if (!status) {
        for (int64_t o = 0; o < num_logits; o++) /* the rows that sample, packed */
            rms_norm(h + logit_rows[o] * H, m->final_norm, 1, H, m->eps, x + o * H);
        q4_quantize_rows(x, 1, num_logits, &xh);
        q4_project(m->lm_head, &xh, num_logits, NULL, logits, 1, panel);
    }
done:
    free(h), free(x), free(qkv), free(gu), free(qa), free(oa), free(own);
    q4_rows_free(&xh), q4_rows_free(&xq), q4_rows_free(&xi);
    return status;
}
