/* sb_paged_decode's signature (attention_cpu.c), for native code that calls the decode
 * attention kernel through a pointer the Python side passes in (draft_cpu.c,
 * decode_step_cpu.c): one implementation of attention for every pass. */
#ifndef SB_ATTENTION_FN_H
#define SB_ATTENTION_FN_H
#include <stdint.h>

typedef int (*AttentionFn)(const void *q, int64_t q_row, int64_t q_head, void *out,
                           int64_t out_row, int64_t out_head, const void *key_cache,
                           const void *value_cache, int64_t block_size, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, int64_t n_seqs,
                           const int64_t *seq_row, const int64_t *seq_queries,
                           const int64_t *seq_start, const int64_t *seq_table,
                           const int64_t *tables, const int64_t *own_slots, float scale, int fp32,
                           int portable);
#endif
