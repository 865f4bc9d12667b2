"""The torch path's prefill chunks against a per-sequence float64 loop: fresh prompts of one
length merged into one batched call, others apart, a chunk over cached context between."""

from __future__ import annotations

import torch

from switchboard_kernels.paged_attention import (
    AttentionMetadata,
    PrefillChunk,
    fresh_runs,
    paged_attention,
    write_kv,
)

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 8, 4


def causal_reference(q, k, v, context: int, scale: float) -> torch.Tensor:
    """[n, heads, dim]: query i sees keys 0..context + i (float64, GQA by repeat)."""
    group = HEADS // KV_HEADS
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        seen = context + i + 1
        scores = torch.einsum("hd,khd->hk", q[i].double(), k[:seen]) * scale
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[:seen])
    return out


def test_fresh_runs_merge_only_adjacent_fresh_chunks_of_one_length():
    def fresh(start, n):
        return PrefillChunk(start, n, 0, None, None)

    cached = PrefillChunk(9, 2, 5, torch.zeros(2, dtype=torch.long), torch.ones(2, 8).bool())
    chunks = [fresh(0, 3), fresh(3, 3), fresh(6, 3), cached, fresh(11, 3), fresh(14, 2)]
    assert [(start, count) for start, count, _ in fresh_runs(chunks)] == [
        (0, 3),
        (9, 1),
        (11, 1),
        (14, 1),
    ]


def test_prefill_chunks_match_a_per_sequence_loop():
    torch.manual_seed(0)
    scale = DIM**-0.5
    num_blocks = 16
    key_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM)
    value_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM)
    # The cached sequence: 6 tokens already in blocks 9 and 3 (shuffled), a 3-token chunk.
    context, cached_len = 6, 3
    cached_table = torch.tensor([9, 3, 12])
    past_k = torch.randn(context, KV_HEADS, DIM)
    past_v = torch.randn(context, KV_HEADS, DIM)
    past_slots = torch.tensor([9 * BLOCK + i for i in range(4)] + [3 * BLOCK, 3 * BLOCK + 1])
    write_kv(past_k, past_v, key_cache, value_cache, past_slots)
    lengths = [5, 5, 5, cached_len, 5, 2]  # three fresh 5s merge; the others stand alone
    total = sum(lengths)
    query = torch.randn(total, HEADS, DIM)
    key = torch.randn(total, KV_HEADS, DIM)
    value = torch.randn(total, KV_HEADS, DIM)
    chunks, slots, start = [], [], 0
    fresh_blocks = [b for b in range(num_blocks) if b not in cached_table.tolist()]
    free_slot = iter(b * BLOCK + i for b in fresh_blocks for i in range(BLOCK))
    for n in lengths:
        if n == cached_len:
            positions = torch.arange(context, context + n)
            slots += [int(cached_table[p // BLOCK]) * BLOCK + int(p) % BLOCK for p in positions]
            mask = torch.arange(len(cached_table) * BLOCK)[None, :] <= positions[:, None]
            chunks.append(PrefillChunk(start, n, context, cached_table, mask))
        else:
            slots += [next(free_slot) for _ in range(n)]
            chunks.append(PrefillChunk(start, n, 0, None, None))
        start += n
    slot_mapping = torch.tensor(slots)
    write_kv(key, value, key_cache, value_cache, slot_mapping)
    meta = AttentionMetadata(slot_mapping=slot_mapping, decode_groups=[], prefills=chunks)
    out = paged_attention(query, key, value, key_cache, value_cache, meta, scale)
    for chunk in chunks:
        rows = slice(chunk.start, chunk.start + chunk.length)
        if chunk.block_table is None:
            want = causal_reference(query[rows], key[rows], value[rows], 0, scale)
        else:
            k = torch.cat([past_k, key[rows]])
            v = torch.cat([past_v, value[rows]])
            want = causal_reference(query[rows], k, v, context, scale)
        torch.testing.assert_close(out[rows].double(), want, rtol=1e-5, atol=1e-5)
