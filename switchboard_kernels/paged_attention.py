"""Paged attention over a flattened batch of decodes and prefill chunks (torch CPU path).

PagedAttention (Kwon et al., SOSP 2023). The K/V of every sequence live in fixed-size
blocks of one cache per layer; a sequence reaches its own through its block table.
Queries arrive flattened: first the decoding sequences' new tokens (one each, or k + 1
when the step verifies k draft tokens), then each prefill chunk's tokens back to back. On
CPU, decodes of a bf16 or fp32 model take the native kernel
(``switchboard_kernels/attention_cpu.c``), which reads each sequence's keys and values in place;
otherwise a sequence's blocks are gathered whole (one contiguous copy per block, which runs at
memory bandwidth, unlike a per-token gather) and padding past the context is masked. Prefill chunks
take SDPA, or with batch-invariant numerics the native kernel too (each chunk a sequence feeding
many queries: every row then attends in one order, alone or beside others, over a cached prefix
or its own fresh keys).

With ``AttentionMetadata.layout`` set (the ``triton`` backend), ``attend`` hands the whole
step to the Triton kernels instead (``switchboard_kernels/paged_attention_triton.py``), imported on
first use so that a process on the torch path never imports triton.

Semantics, per sequence with context ``c`` (tokens already cached) and chunk length ``n``:
``out[i] = softmax(scale * q[i] · K[:c+i+1]ᵀ) · V[:c+i+1]`` for i in 0..n-1, with query head
``h`` reading KV head ``h // (num_heads // num_kv_heads)`` (grouped-query attention).
Two departures some families take, per layer: a sliding window ``W`` (a query at position ``p``
sees only the keys at positions ``p - W < j <= p``: Mistral, Gemma 2/3), and a soft-cap on the
scores (``cap * tanh(s / cap)`` before the softmax: Gemma 2). Both are masks and math on the same
paths, in the native decode kernel and in the Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from switchboard_kernels.attention_native import NativeDecodes, native_attention
from switchboard_kernels.paged_layout import PagedLayout


@dataclass(slots=True)
class PrefillChunk:
    start: int  # offset of the chunk's first token in the flattened batch
    length: int  # n: tokens in this chunk
    context_len: int  # c: tokens of this sequence already in the cache before this step
    # [num_blocks] int64 block table covering c + n tokens; None when c == 0, where the
    # chunk's own fresh K/V are used directly.
    block_table: torch.Tensor | None
    # [n, num_blocks * block_size] bool, True where attending is allowed; None when c == 0
    # (plain causal).
    mask: torch.Tensor | None

    def to(self, device: torch.device) -> PrefillChunk:
        return PrefillChunk(
            self.start,
            self.length,
            self.context_len,
            None if self.block_table is None else self.block_table.to(device),
            None if self.mask is None else self.mask.to(device),
        )


@dataclass(slots=True)
class DecodeGroup:
    """Decoding sequences of similar context length, attended in one batched call.

    Each feeds ``queries`` new tokens: 1 for a plain decode, k + 1 when a speculative step
    verifies k drafts. Padding every sequence to the batch's longest context would make a
    long chat pay for its short neighbours; grouping by length keeps the padded work near
    the real work, and one call per group (not per sequence) keeps verification cheap.
    """

    start: int  # first row of the group in the flattened batch
    count: int  # sequences in the group; rows start .. start + count * queries
    queries: int  # new tokens per sequence, back to back in the flattened batch
    block_tables: torch.Tensor  # [count * max_blocks] int64: padded tables, back to back
    # [count, 1, group * queries, max_blocks * block_size] bool, True = attend, where
    # group = heads per KV head; row g * queries + i belongs to the sequence's query i.
    mask: torch.Tensor

    def to(self, device: torch.device) -> DecodeGroup:
        return DecodeGroup(
            self.start,
            self.count,
            self.queries,
            self.block_tables.to(device),
            self.mask.to(device),
        )


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about the batch layout; built once a step, shared by layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat slot (block * size + offset) to write
    decode_groups: list[DecodeGroup]  # covering the first rows, before the prefill chunks
    prefills: list[PrefillChunk]
    # The decodes for the native kernel instead of ``decode_groups`` (CPU, bf16 or fp32).
    native_decodes: NativeDecodes | None = None
    # The whole step for the Triton kernels (groups and chunks then empty).
    layout: PagedLayout | None = None
    # ``native_decodes`` holds prefill chunks too (batch-invariant numerics; ``prefills`` empty).
    native_prefills: bool = False

    @property
    def all_decode(self) -> bool:
        """No prefill chunk (on the Triton layout: no sequence past the decode launch's rows)."""
        if self.layout is not None:
            return self.layout.prefill.count == 0
        return not self.prefills and not self.native_prefills

    def to(self, device: torch.device) -> AttentionMetadata:
        """The same metadata with its tensors on ``device`` (the native decodes stay on the
        host, where their kernel runs)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping.to(device),
            decode_groups=[g.to(device) for g in self.decode_groups],
            prefills=[c.to(device) for c in self.prefills],
            native_decodes=self.native_decodes,
            layout=None if self.layout is None else self.layout.to(device),
            native_prefills=self.native_prefills,
        )


def attend(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], this step's fresh keys
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    positions: torch.Tensor | None = None,  # [num_tokens] int64, needed with a window
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Write the fresh keys and values to their slots, then attend, on the metadata's path."""
    if meta.layout is None:
        write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        return paged_attention(
            query,
            key,
            value,
            key_cache,
            value_cache,
            meta,
            scale,
            window=window,
            softcap=softcap,
            positions=positions,
        )
    from switchboard_kernels import paged_attention_triton as tri

    tri.write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
    out = query.new_empty(query.shape)
    tri.decode(
        query, key_cache, value_cache, meta.layout, scale, out, window=window, softcap=softcap
    )
    tri.prefill(
        query, key_cache, value_cache, meta.layout, scale, out, window=window, softcap=softcap
    )
    return out


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Semantics: ``key_cache.flatten(0, 1)[slot_mapping[t]] = key[t]`` (same for values)."""
    key_cache.view(-1, *key.shape[1:]).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, *value.shape[1:]).index_copy_(0, slot_mapping, value)


def gather_blocks(
    cache: torch.Tensor, block_tables: torch.Tensor, rows: int, seen: torch.Tensor
) -> torch.Tensor:
    """[rows, blocks_per_row * block_size, kv_heads, dim]: the listed blocks, back to back, with
    every slot that no query of its row sees (``seen``: [rows, span] bool) set to zero.

    Those slots hold whatever a freed block or a padding block last held, another sequence's
    K/V, possibly inf or NaN. A masked score gets weight 0, but 0 x NaN is NaN, and SDPA adds a
    boolean mask as -inf to a score that is already NaN; so the slots are overwritten (a select,
    not a product) and nothing of their contents reaches the output."""
    gathered = cache.index_select(0, block_tables).view(rows, -1, *cache.shape[2:])
    return gathered.masked_fill_(~seen.view(rows, -1, 1, 1), 0)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], this step's fresh keys
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], holds `key`
    value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    positions: torch.Tensor | None = None,  # [num_tokens] int64, needed with a window
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if window is not None and positions is None:
        raise ValueError("a sliding window needs the rows' positions")
    out = torch.empty_like(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    for g in meta.decode_groups:
        n = g.queries
        rows = slice(g.start, g.start + g.count * n)
        # A KV head's query heads and the sequence's n positions share SDPA's query axis,
        # so one call serves the group without repeating K/V: [count, kv_heads, group * n,
        # dim], row g * n + i for head g of the KV group at position i.
        q = query[rows].view(g.count, n, num_kv_heads, group, head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(g.count, num_kv_heads, group * n, head_dim)
        seen = g.mask.any(dim=2).view(g.count, -1)  # [count, span]: slots some row sees
        k = gather_blocks(key_cache, g.block_tables, g.count, seen).transpose(1, 2)
        v = gather_blocks(value_cache, g.block_tables, g.count, seen).transpose(1, 2)
        # k, v: [count, kv_heads, max_blocks * block_size, dim]
        mask = g.mask
        if window is not None:
            inside = _in_window(positions[rows].view(g.count, n), k.shape[2], window)
            # [count, n, span] -> row g * n + i of the group's query axis
            mask = mask & inside.repeat(1, mask.shape[2] // n, 1).unsqueeze(1)
        o = _attention(q, k, v, mask, False, scale, softcap, False)
        o = o.view(g.count, num_kv_heads, group, n, head_dim).permute(0, 3, 1, 2, 4)
        out[rows] = o.reshape(g.count * n, num_heads, head_dim)
    if meta.native_decodes is not None:
        kernel = native_attention()
        if kernel is None:
            raise ValueError("metadata planned for the native attention kernel, not built here")
        kernel.decode(
            query,
            out,
            key_cache,
            value_cache,
            meta.native_decodes,
            scale,
            window=window,
            softcap=softcap,
        )
    for start, count, chunk in fresh_runs(meta.prefills):
        # ``count`` chunks of one length back to back: [count, heads, n, dim] in one call.
        rows = slice(start, start + count * chunk.length)
        q = query[rows].view(count, chunk.length, num_heads, head_dim).transpose(1, 2)
        if chunk.block_table is None:
            k = key[rows].view(count, chunk.length, num_kv_heads, head_dim).transpose(1, 2)
            v = value[rows].view(count, chunk.length, num_kv_heads, head_dim).transpose(1, 2)
        else:
            seen = chunk.mask.any(dim=0).view(1, -1)  # [1, span]: the sequence's own slots
            k = gather_blocks(key_cache, chunk.block_table, 1, seen).transpose(1, 2)
            v = gather_blocks(value_cache, chunk.block_table, 1, seen).transpose(1, 2)
        mask = chunk.mask
        if window is not None and (mask is not None or chunk.length > window):
            inside = _in_window(positions[rows][: chunk.length], k.shape[2], window)
            # a fresh chunk's rows are at positions 0 .. n - 1, its keys the same
            mask = inside & (mask if mask is not None else inside.new_ones(inside.shape).tril())
        o = _attention(q, k, v, mask, mask is None, scale, softcap, group > 1)
        out[rows] = o.transpose(1, 2).reshape(count * chunk.length, num_heads, head_dim)
    return out


def _in_window(positions: torch.Tensor, span: int, window: int) -> torch.Tensor:
    """[..., span] bool: key j is inside the window of a query at each position (j > p - W)."""
    keys = torch.arange(span, device=positions.device)
    return keys > (positions.unsqueeze(-1) - window)


def _attention(
    q: torch.Tensor,  # [..., heads, rows, dim]
    k: torch.Tensor,  # [..., kv_heads, keys, dim]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # broadcast to [..., heads, rows, keys], True = attend
    is_causal: bool,
    scale: float,
    softcap: float | None,
    gqa: bool,
) -> torch.Tensor:
    """SDPA, or with a soft-cap (which SDPA has not) the same written out, as HF's eager path
    computes it: ``softmax(cap * tanh(scale * q kᵀ / cap) + mask) v``."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
    if gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap
    if mask is None and is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def fresh_runs(chunks: list[PrefillChunk]) -> list[tuple[int, int, PrefillChunk]]:
    """The chunks as (first row, count, a chunk): fresh prompts of one length that follow
    each other in the batch merge into one run, attended in one batched call (a burst of
    same-length prompts would otherwise pay SDPA's per-call cost per prompt and layer);
    a chunk over cached context is a run of its own."""
    runs: list[tuple[int, int, PrefillChunk]] = []
    for chunk in chunks:
        if runs and chunk.block_table is None:
            start, count, last = runs[-1]
            follows = start + count * last.length == chunk.start
            if last.block_table is None and last.length == chunk.length and follows:
                runs[-1] = (start, count + 1, last)
                continue
        runs.append((chunk.start, 1, chunk))
    return runs
