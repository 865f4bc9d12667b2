"""Torch references for the Triton paged-attention kernels: same signatures, any dtype.

Semantics, per row r of a sequence (``switchboard_kernels.paged_layout``), with K and V the
sequence's keys and values reached through its block table:
``out[r, h] = softmax(scale * q[r, h] · K[j]ᵀ) · V[j]`` over the keys j with
``j <= row_last[r]`` or ``j == row_self[r]``; query head h reads KV head ``h // group``.
With a ``window`` W, of the keys ``j <= row_last[r]`` only those after ``p - W`` are seen, p the
row's position (``row_last[r]``, or one past it for a draft row off its chain); with a
``softcap`` each score s becomes ``softcap * tanh(s / softcap)``.
Computed in the query's dtype, so float64 inputs give a float64 reference.
"""

from __future__ import annotations

import torch

from switchboard_kernels.paged_layout import PagedLayout, Tiles


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] integer, -1 = padding, not written
) -> None:
    """Semantics: ``key_cache.flatten(0, 1)[slot_mapping[t]] = key[t]`` (and values) for
    every slot >= 0."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache.view(-1, *key.shape[1:]).index_copy_(0, slots, key[keep].to(key_cache.dtype))
    value_cache.view(-1, *value.shape[1:]).index_copy_(0, slots, value[keep].to(value_cache.dtype))


def decode(
    query: torch.Tensor,  # [num_rows, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    layout: PagedLayout,
    scale: float,
    out: torch.Tensor,  # [num_rows, num_heads, head_dim], the decode tiles' rows written
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """The decode tiles' rows (split-K changes how, not what)."""
    _attend(query, key_cache, value_cache, layout, layout.decode, scale, out, window, softcap)


def prefill(
    query: torch.Tensor,  # [num_rows, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    layout: PagedLayout,
    scale: float,
    out: torch.Tensor,  # [num_rows, num_heads, head_dim], the prefill tiles' rows written
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """The prefill tiles' rows."""
    _attend(query, key_cache, value_cache, layout, layout.prefill, scale, out, window, softcap)


def _attend(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    layout: PagedLayout,
    tiles: Tiles,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    block_size = key_cache.shape[1]
    group = query.shape[1] // key_cache.shape[2]
    for seq, row0, rows, keys in tiles.table.tolist():
        if rows == 0:
            continue
        blocks = layout.block_tables[seq, : -(-keys // block_size)].long()
        # [keys, heads, dim]: the sequence's keys and values, each KV head repeated for its group
        k = key_cache[blocks].flatten(0, 1)[:keys].to(query.dtype).repeat_interleave(group, 1)
        v = value_cache[blocks].flatten(0, 1)[:keys].to(query.dtype).repeat_interleave(group, 1)
        q = query[row0 : row0 + rows]  # [rows, heads, dim]
        scores = scale * torch.einsum("rhd,khd->rhk", q, k)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        j = torch.arange(keys, device=query.device)
        last = layout.row_last[row0 : row0 + rows, None].long()
        own = layout.row_self[row0 : row0 + rows, None].long()
        chain = j <= last
        if window is not None:
            position = last + (own != last).long()
            chain &= j > position - window
        seen = chain | (j == own)  # [rows, keys]
        scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
        attended = torch.einsum("rhk,khd->rhd", scores.softmax(-1), v)
        out[row0 : row0 + rows] = attended.to(out.dtype)
