/* A served model's decode step in one native call, computing exactly what its torch path
 * computes (worker/model/llama.py: `forward` and `compute_logits`, for sequences that each
 * feed one token and sample after it, with plain LoRA adapters or none).
 *
 * Why: a decode step of the default model through torch makes ~330 calls (two norms, four
 * projections, RoPE as four tensor ops, the K/V writes, attention, splits and views, a
 * layer), each paying Python, the dispatcher and its code's cache misses. At batch 1 on a
 * 2-core Zen 4 that was ~4 ms of a ~12.5 ms step, on top of the 8.7 ms that reading the
 * weights takes (docs/performance.md); for a base quantized to 4 bits, whose weights read
 * in a third of that, it was half the step. Here the loop over layers is C and every call
 * into a kernel a plain function call.
 *
 * Exactness: every product, norm, activation and attention is the kernel the torch path
 * calls for the same rows (their addresses passed in; switchboard_kernels/decode_step_native.py
 * builds the step only where the model's plans pick those kernels), on the same inputs in
 * the same dtypes. The glue written here rounds as torch's ops round: the embedding row
 * widened to the fp32 residual stream; RoPE as `addcmul(x * cos, roll(x), signed_sin)`: the
 * first product rounded to the model's dtype, then the second product and the sum in one
 * fp32 FMA (ATen's addcmul; in bf16 that product is exact anyway), rounded once; the fresh
 * K/V copied into their slots before attention reads them. Tests compare the logits and the
 * caches bit for bit with the torch path's.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "attention_fn.h"
#include "rope.h"

/* sb_linear_bf16 / sb_linear (linear_bf16_cpu.c, linear_cpu.c): y = x W^T (+ res). */
typedef void (*PanelFn)(const void *w, const void *x, int64_t rows, const void *res, void *y);
/* sb_wq_linear (wq_cpu.c). */
typedef int (*WqFn)(const void *w, const void *x, int x_fp32, int64_t rows, const void *res,
                    void *y, int out_fp32, int path);
/* sb_rms_norm_f32_bf16 / sb_rms_norm_f32 (norm_cpu.c). */
typedef void (*NormFn)(const void *x, int64_t x_stride, const void *w, void *out,
                       int64_t out_stride, int64_t rows, int64_t dim, float eps);
/* sb_silu_mul_bf16 / sb_silu_mul_f32 (activation_cpu.c). */
typedef void (*ActivationFn)(const void *gate_up, int64_t in_stride, void *out,
                             int64_t out_stride, int64_t rows, int64_t dim, int portable);

/* sb_lora_bgmv (lora_cpu.c): y[rows of each group] += scale * x A^T B^T of its slot. */
typedef int (*LoraFn)(const void *x, int64_t x_stride, int64_t in, void *y, int64_t y_stride,
                      const int64_t *table, const float *scales, int64_t n_groups,
                      const int64_t *group_slot, const int64_t *group_start, const int64_t *rows,
                      int fp32, int portable);

enum { PANELS = 0, WQ = 1 };
enum { LORA_QKV = 0, LORA_O = 1, LORA_GATE_UP = 2, LORA_DOWN = 3 }; /* a layer's groups */

struct sb_step_projection {
    int64_t kind;         /* PANELS or WQ */
    const void *fn;       /* PanelFn or WqFn */
    const void *desc;     /* the kernel's weights; panels: out in the rows' dtype, or fp32 for
                           * an output layer */
    const void *sum_desc; /* panels of a bf16 model: the same weights with fp32 out, which
                           * add an fp32 residual to the fp32 sums */
    int64_t out_fp32;     /* WQ: its products come out fp32 (an output layer) */
};

struct sb_step_layer {
    const void *input_norm, *post_norm; /* [hidden], the model's dtype */
    struct sb_step_projection qkv, o, gate_up, down;
};

struct sb_step_model {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    int64_t logits_width; /* the output layer's out features */
    float eps, scale;
    int64_t fp32;                /* the model in fp32; else bf16 with an fp32 residual stream */
    const void *embed;           /* [vocab, hidden], the model's dtype */
    const void *final_norm;      /* [hidden] */
    const void *cos, *signed_sin; /* [max_positions, head_dim], the model's dtype */
    const struct sb_step_layer *layers;
    struct sb_step_projection lm_head; /* fp32 out */
    void *const *key_caches;           /* per layer [num_blocks, block_size, kv_heads, dim] */
    void *const *value_caches;
    const void *norm;       /* NormFn: fp32 rows in, the weight's dtype out */
    const void *activation; /* ActivationFn in the model's dtype */
    const void *attention;  /* AttentionFn */
};

/* One LoRA group of one layer: the slots' pointer table (lora_native.py's NativeSlots), NULL
 * where no adapter targets it, and the slots' scales. */
struct sb_step_lora_group {
    const int64_t *table;
    const float *scales;
};

/* A step's adapters: its rows grouped by slot (NativeGroups), the same for every layer. */
struct sb_step_lora {
    int64_t num_groups;
    const int64_t *slots, *starts, *rows;
    const struct sb_step_lora_group *groups; /* [num_layers][4]: LORA_QKV, _O, _GATE_UP, _DOWN */
    const void *bgmv;                        /* LoraFn */
};

/* y += the LoRA delta of group g of layer l (add_lora in switchboard_kernels/lora.py). */
static int add_lora(const struct sb_step_lora *lora, int64_t l, int g, const void *x, int64_t in,
                    void *y, int64_t y_stride, int fp32) {
    if (!lora) return 0;
    const struct sb_step_lora_group *G = lora->groups + 4 * l + g;
    if (!G->table || !lora->num_groups) return 0;
    return ((LoraFn)lora->bgmv)(x, in, in, y, y_stride, G->table, G->scales, lora->num_groups,
                                lora->slots, lora->starts, lora->rows, fp32, 0);
}

/* The LoRA delta of a projection that adds to the stream (o, down) into stream `out`, as
 * llama.py's `_added_to_stream` adds it: an fp32 model's straight into the sum; a bf16
 * model's computed apart into zeros in bf16 and added after (so a base row's bits never
 * depend on its neighbours' adapters). `delta`: [rows, out_features] bf16 scratch. */
static int add_lora_to_stream(const struct sb_step_lora *lora, int64_t l, int g, const void *x,
                              int64_t in, int64_t rows, int64_t width, int fp32, float *out,
                              uint16_t *delta) {
    if (!lora || !lora->groups[4 * l + g].table || !lora->num_groups) return 0;
    if (fp32) return add_lora(lora, l, g, x, in, out, width, 1);
    memset(delta, 0, sizeof(uint16_t) * rows * width);
    int status = add_lora(lora, l, g, x, in, delta, width, 0);
    for (int64_t i = 0; i < rows * width; i++) out[i] += bf16_to_f32(delta[i]);
    return status;
}

/* rows x W^T, out in the rows' dtype (fp32 for an output layer). */
static int project(const struct sb_step_projection *p, const void *x, int64_t rows, int fp32,
                   void *y) {
    if (p->kind == WQ) return ((WqFn)p->fn)(p->desc, x, fp32, rows, NULL, y, fp32 || p->out_fp32, 0);
    ((PanelFn)p->fn)(p->desc, x, rows, NULL, y);
    return 0;
}

/* out = stream + rows x W^T, fp32 (the residual stream), from fp32 sums never rounded. */
static int add_to_stream(const struct sb_step_projection *p, const void *x, int64_t rows,
                         int fp32, const float *stream, float *out) {
    if (p->kind == WQ) return ((WqFn)p->fn)(p->desc, x, fp32, rows, stream, out, 1, 0);
    ((PanelFn)p->fn)(fp32 ? p->desc : p->sum_desc, x, rows, stream, out);
    return 0;
}

static inline float load1(const void *base, int64_t i, int fp32) {
    return fp32 ? ((const float *)base)[i] : bf16_to_f32(((const uint16_t *)base)[i]);
}

/* Semantics: the model's forward pass over `rows` sequences feeding one token each: row r
 * feeds tokens[r] at positions[r] (> 0: the sequence has cached tokens), its K/V written
 * to flat cache slot slots[r]; it attends keys 0 .. positions[r] through its block table,
 * tables[table_starts[r]:]. With `lora` (nullable), each projection group's LoRA delta
 * added for the rows of its adapters. Then logits[r] = lm_head(final_norm(h[r])), fp32
 * [rows, logits_width]. `interrupt` (nullable) is read before each layer: nonzero stops the
 * step there (another thread set it: worker/model/step_interrupt.py), its K/V written so far
 * left for the step that runs again. Returns 0, SB_STEP_INTERRUPTED, -1 if scratch memory
 * ran out, or a kernel's error (negative). */
#define SB_STEP_INTERRUPTED 1
int sb_decode_step(const struct sb_step_model *m, int64_t rows, const int64_t *tokens,
                   const int64_t *positions, const int64_t *slots, const int64_t *table_starts,
                   const int64_t *tables, const struct sb_step_lora *lora, float *logits,
                   const int32_t *interrupt) {
    const int fp32 = (int)m->fp32;
    const int64_t H = m->hidden, hd = m->head_dim, Q = m->heads * hd, KV = m->kv_heads * hd;
    const int64_t QKV = Q + 2 * KV, I = m->intermediate, elem = fp32 ? 4 : 2;
    const NormFn norm = (NormFn)m->norm;
    const ActivationFn activation = (ActivationFn)m->activation;
    const AttentionFn attention = (AttentionFn)m->attention;
    float *stream = malloc(sizeof(float) * rows * H), *next = malloc(sizeof(float) * rows * H);
    char *x = malloc(elem * rows * (H > I ? H : I)), *qkv = malloc(elem * rows * QKV);
    char *attended = malloc(elem * rows * Q), *gate_up = malloc(elem * rows * 2 * I);
    int64_t *meta = malloc(sizeof(int64_t) * rows * 4);
    uint16_t *delta = lora ? malloc(sizeof(uint16_t) * rows * H) : NULL;
    int status = -1;
    if (!stream || !next || !x || !qkv || !attended || !gate_up || !meta || (lora && !delta))
        goto done;
    int64_t *seq_row = meta, *seq_queries = meta + rows, *seq_start = meta + 2 * rows;
    int64_t *own_slots = meta + 3 * rows;
    for (int64_t r = 0; r < rows; r++) {
        seq_row[r] = r, seq_queries[r] = 1, seq_start[r] = positions[r], own_slots[r] = -1;
        for (int64_t i = 0; i < H; i++) stream[r * H + i] = load1(m->embed, tokens[r] * H + i, fp32);
    }
    status = 0;
    for (int64_t l = 0; l < m->num_layers && !status; l++) {
        if (interrupt && __atomic_load_n(interrupt, __ATOMIC_RELAXED)) {
            status = SB_STEP_INTERRUPTED;
            break;
        }
        const struct sb_step_layer *L = m->layers + l;
        norm(stream, H, L->input_norm, x, H, rows, H, m->eps);
        if ((status = project(&L->qkv, x, rows, fp32, qkv))) break;
        if ((status = add_lora(lora, l, LORA_QKV, x, H, qkv, QKV, fp32))) break;
        for (int64_t r = 0; r < rows; r++) { /* [q heads | k heads | v heads] */
            char *row = qkv + r * QKV * elem;
            int64_t table = positions[r] * hd;
            if (fp32)
                rope_heads_f32((float *)row, m->heads + m->kv_heads, hd,
                               (const float *)m->cos + table,
                               (const float *)m->signed_sin + table);
            else
                rope_heads_bf16((uint16_t *)row, m->heads + m->kv_heads, hd,
                                (const uint16_t *)m->cos + table,
                                (const uint16_t *)m->signed_sin + table);
            memcpy((char *)m->key_caches[l] + slots[r] * KV * elem, row + Q * elem, KV * elem);
            memcpy((char *)m->value_caches[l] + slots[r] * KV * elem, row + (Q + KV) * elem,
                   KV * elem);
        }
        status = attention(qkv, QKV, hd, attended, Q, hd, m->key_caches[l], m->value_caches[l],
                           m->block_size, m->heads, m->kv_heads, hd, rows, seq_row, seq_queries,
                           seq_start, table_starts, tables, own_slots, m->scale, fp32, 0);
        if (status || (status = add_to_stream(&L->o, attended, rows, fp32, stream, next))) break;
        status = add_lora_to_stream(lora, l, LORA_O, attended, Q, rows, H, fp32, next, delta);
        if (status) break;
        float *swap = stream;
        stream = next, next = swap;
        norm(stream, H, L->post_norm, x, H, rows, H, m->eps);
        if ((status = project(&L->gate_up, x, rows, fp32, gate_up))) break;
        if ((status = add_lora(lora, l, LORA_GATE_UP, x, H, gate_up, 2 * I, fp32))) break;
        activation(gate_up, 2 * I, x, I, rows, I, 0);
        if ((status = add_to_stream(&L->down, x, rows, fp32, stream, next))) break;
        if ((status = add_lora_to_stream(lora, l, LORA_DOWN, x, I, rows, H, fp32, next, delta))) break;
        swap = stream, stream = next, next = swap;
    }
    if (!status) {
        norm(stream, H, m->final_norm, x, H, rows, H, m->eps);
        status = project(&m->lm_head, x, rows, fp32, logits);
    }
done:
    free(stream), free(next), free(x), free(qkv), free(attended), free(gate_up), free(meta);
    free(delta);
    return status;
}
