"""Paged attention over a flattened batch of decodes and prefill chunks (torch CPU path).

PagedAttention (Kwon et al., SOSP 2023). The K/V of every sequence live in blocks of one
flat cache per layer; a sequence reaches its own through slot indices derived from its
block table. Queries arrive flattened: first one token per decoding sequence, then each
prefill chunk's tokens back to back.

Semantics, per sequence with context ``c`` (tokens already cached) and chunk length ``n``:
``out[i] = softmax(scale * q[i] · K[:c+i+1]ᵀ) · V[:c+i+1]`` for i in 0..n-1, with query head
``h`` reading KV head ``h // (num_heads // num_kv_heads)`` (grouped-query attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    start: int  # offset of the chunk's first token in the flattened batch
    length: int  # n: tokens in this chunk
    context_len: int  # c: tokens of this sequence already in the cache before this step
    # [c + n] flat cache slots of the whole attended span; None when c == 0, where the
    # chunk's own fresh K/V are used directly.
    key_slots: torch.Tensor | None
    # [n, c + n] bool, True where attending is allowed; None when c == 0 (plain causal).
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about the batch layout; built once a step, shared by layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each token's K/V are written
    num_decodes: int  # the first num_decodes tokens are single-token decodes
    decode_key_slots: torch.Tensor | None  # [num_decodes, max_ctx] int64 (padded with 0)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_ctx] bool, True = attend
    prefills: list[PrefillChunk]


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Semantics: ``key_cache[slot_mapping[t]] = key[t]`` (same for values)."""
    key_cache.index_copy_(0, slot_mapping, key)
    value_cache.index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], this step's fresh keys
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], already holds `key`
    value_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    out = torch.empty_like(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    if meta.num_decodes:
        d = meta.num_decodes
        # The query heads of one KV group stand in for the query-length axis, so one
        # SDPA call serves every decode without repeating K/V: [d, kv_heads, group, dim].
        q = query[:d].view(d, num_kv_heads, group, head_dim)
        k = key_cache[meta.decode_key_slots].transpose(1, 2)  # [d, kv_heads, ctx, dim]
        v = value_cache[meta.decode_key_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scale)
        out[:d] = o.reshape(d, num_heads, head_dim)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        q = query[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
        if chunk.key_slots is None:
            k, v = key[rows], value[rows]
        else:
            k, v = key_cache[chunk.key_slots], value_cache[chunk.key_slots]
        k = k.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, c + n, dim]
        v = v.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out
