"""Paged attention and the K/V cache write in Triton, reading K/V in place through block tables.

PagedAttention (Kwon et al., SOSP 2023) with FlashAttention's online softmax (Dao et al.,
2022) and, for long decodes, flash-decoding's split-K (Dao et al., 2023): each split
attends a slice of the keys and a reduce kernel merges the slices by their maxima and sums.
Same signatures and semantics as ``switchboard_kernels/paged_attention_reference.py``; the layout of
the step (``PagedLayout``: tiles of query rows, per-row key ranges) is described in
``switchboard_kernels/paged_layout.py``.

One kernel serves both launches. A program takes one tile (up to ``block_q`` query rows of a
sequence) and one KV head: all query heads of that KV head share its loads (grouped-query
attention), laid out as the rows of one [block_q * group, head_dim] query tile, so K and V
are read once per KV head. Decode tiles (one row, or k + 1 verification rows) may split the
keys over programs; prefill tiles (chunks, causal within the chunk, over any cached context)
do not. What is loaded is converted to fp32 at once: the interpreter computes bf16 wrongly,
and the references accumulate in fp32 or wider.

A sliding window W (``window`` > 0) hides the chain keys at or before ``p - W`` from a row at
position p (p is its last key, or one past it for a draft row off its chain, which still sees
itself); a soft-cap turns each score s into ``cap * tanh(s / cap)`` before the softmax. A tile's
programs walk its keys from the earliest window start of its rows, so a windowed decode reads
about a window of keys, not its whole context.

To run on CPU tensors, set ``TRITON_INTERPRET=1`` before triton is first imported (see
``switchboard_kernels/lora_triton.py``). ``switchboard_kernels.paged_attention`` imports this module
lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from switchboard_kernels.paged_layout import PagedLayout, Tiles

MIN_DOT = 16  # tl.dot needs every tile dimension >= 16
BLOCK_N = {"cuda": 64, "cpu": 32}  # keys per step of a program's loop
WRITE_TILE = {"cuda": 2048, "cpu": 4096}  # elements a K/V write program copies
LOG2E = 1.4426950408889634


@triton.jit
def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, stats_ptr,
    tables_ptr, row_last_ptr, row_self_ptr, tiles_ptr,
    qk_scale, block_size, head_dim,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_co, stride_ch, stride_table,
    window, softcap_log2,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOWED: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tiles_ptr + tile * 4)
    row0 = tl.load(tiles_ptr + tile * 4 + 1)
    rows = tl.load(tiles_ptr + tile * 4 + 2)
    keys = tl.load(tiles_ptr + tile * 4 + 3)
    # Tile row m is query row m // GROUP of the tile, query head m % GROUP of this KV head.
    m = tl.arange(0, BLOCK_M)
    m_valid = m // GROUP < rows
    row = row0 + m // GROUP
    head = kv_head * GROUP + m % GROUP
    d = tl.arange(0, BLOCK_D)
    d_valid = d < head_dim
    q = tl.load(
        q_ptr + row[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=m_valid[:, None] & d_valid[None, :],
        other=0.0,
    ).to(tl.float32)
    q = q * qk_scale  # scale * log2(e): the softmax runs in base 2
    last = tl.load(row_last_ptr + row, mask=m_valid, other=-1)
    own = tl.load(row_self_ptr + row, mask=m_valid, other=-1)
    # The tile's keys: from the earliest window start of its rows (else from 0). This split's:
    # a whole number of key steps each, the last split what is left.
    if WINDOWED:  # the first chain key each row sees: past its window (position - W)
        first = last + (own != last).to(last.dtype) - window + 1
        base = tl.maximum(tl.min(tl.where(m_valid, first, keys), 0), 0).to(tl.int32)
    else:
        base = 0
    per_split = tl.cdiv(tl.cdiv(keys - base, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = base + split * per_split
    hi = tl.minimum(keys, lo + per_split)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_table
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_valid = n < hi
        block = tl.load(table + n // block_size, mask=n_valid, other=0).to(tl.int64)
        slot = block * stride_cb + (n % block_size) * stride_co + kv_head * stride_ch  # [BN]
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION)  # [BM, BN]
        if SOFTCAP:  # cap * tanh(s / cap) in base-2 units: tanh(x) = 1 - 2 / (e^2x + 1)
            s = softcap_log2 * (1.0 - 2.0 / (tl.exp2(2.0 * LOG2E * s / softcap_log2) + 1.0))
        chain = n[None, :] <= last[:, None]
        if WINDOWED:
            chain = chain & (n[None, :] >= first[:, None])
        seen = chain | (n[None, :] == own[:, None])
        s = tl.where(seen & n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        m_i = m_new
    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out = out_ptr + row[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh
        out_mask = m_valid[:, None] & d_valid[None, :]
        tl.store(out + d[None, :], o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials by (tile, KV head, split): [.., BLOCK_M, BLOCK_D] and [.., BLOCK_M, 2].
        part = ((tile * tl.num_programs(1) + kv_head) * NUM_SPLITS + split).to(tl.int64)
        tl.store(part_ptr + (part * BLOCK_M + m[:, None]) * BLOCK_D + d[None, :], acc)
        tl.store(stats_ptr + (part * BLOCK_M + m) * 2, m_i)
        tl.store(stats_ptr + (part * BLOCK_M + m) * 2 + 1, l_i)


@triton.jit
def _reduce_splits_kernel(
    out_ptr, part_ptr, stats_ptr, tiles_ptr, head_dim, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    row0 = tl.load(tiles_ptr + tile * 4 + 1)
    rows = tl.load(tiles_ptr + tile * 4 + 2)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_valid = m // GROUP < rows
    first = ((tile * tl.num_programs(1) + kv_head) * NUM_SPLITS).to(tl.int64)
    m_all = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        m_all = tl.maximum(m_all, tl.load(stats_ptr + ((first + s) * BLOCK_M + m) * 2))
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # no split saw a key: zeros
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for s in range(NUM_SPLITS):
        stats = stats_ptr + ((first + s) * BLOCK_M + m) * 2
        weight = tl.exp2(tl.load(stats) - m_all)  # 0 for a split that saw no key
        total += weight * tl.load(stats + 1)
        part = tl.load(part_ptr + ((first + s) * BLOCK_M + m[:, None]) * BLOCK_D + d[None, :])
        acc += weight[:, None] * part
    o = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    row = row0 + m // GROUP
    head = kv_head * GROUP + m % GROUP
    out = out_ptr + row[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & (d < head_dim)[None, :])


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    num_tokens, block_size, head_dim, width,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_co, stride_ch,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slots_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    w = tl.arange(0, BLOCK_W)  # KV head w // head_dim, feature w % head_dim
    head, d = w // head_dim, w % head_dim
    mask = (slot >= 0)[:, None] & (w < width)[None, :]
    block, offset = slot // block_size, slot % block_size
    cache = (block * stride_cb + offset * stride_co)[:, None] + (head * stride_ch + d)[None, :]
    t64 = t.to(tl.int64)[:, None]
    k = tl.load(key_ptr + t64 * stride_kt + (head * stride_kh + d)[None, :], mask=mask)
    tl.store(k_cache_ptr + cache, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + (head * stride_vh + d)[None, :], mask=mask)
    tl.store(v_cache_ptr + cache, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] integer, -1 = padding, not written
) -> None:
    """Semantics: ``key_cache.flatten(0, 1)[slot_mapping[t]] = key[t]`` (and values) for
    every slot >= 0."""
    _check_cache(key_cache, value_cache)
    key, value = _last_dense(key), _last_dense(value)
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    width = kv_heads * head_dim
    block_w = triton.next_power_of_2(width)
    block_t = max(1, WRITE_TILE[_kind(key)] // block_w)
    block_t = min(block_t, triton.next_power_of_2(num_tokens))
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, key_cache, value_cache, slot_mapping,
        num_tokens, key_cache.shape[1], head_dim, width,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), *key_cache.stride()[:3],
        BLOCK_T=block_t, BLOCK_W=block_w,
    )  # fmt: skip


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
    """The decode tiles' rows, split-K over ``layout.decode.num_splits`` programs."""
    _launch(query, key_cache, value_cache, layout, layout.decode, scale, out, window, softcap)


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
    _launch(query, key_cache, value_cache, layout, layout.prefill, scale, out, window, softcap)


def _launch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    layout: PagedLayout,
    tiles: Tiles,
    scale: float,
    out: torch.Tensor,
    window: int | None,
    softcap: float | None,
) -> None:
    _check_cache(key_cache, value_cache)
    query = _last_dense(query)
    if out.stride(-1) != 1 or query.shape != out.shape:
        raise ValueError("paged attention: out must match the query, features contiguous")
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    num_heads = query.shape[1]
    if num_heads % kv_heads or query.shape[2] != head_dim:
        raise ValueError(f"paged attention: {num_heads} query heads over {kv_heads} KV heads")
    if tiles.count == 0:
        return
    group = num_heads // kv_heads
    splits = tiles.num_splits
    block_m = max(MIN_DOT, triton.next_power_of_2(tiles.block_q * group))
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    part = stats = out  # unused without split-K
    if splits > 1:
        partials = (tiles.count, kv_heads, splits, block_m)
        part = query.new_empty((*partials, block_d), dtype=torch.float32)
        stats = query.new_empty((*partials, 2), dtype=torch.float32)  # max, sum
    _attention_kernel[(tiles.count, kv_heads, splits)](
        query, key_cache, value_cache, out, part, stats,
        layout.block_tables, layout.row_last, layout.row_self, tiles.table,
        scale * LOG2E, key_cache.shape[1], head_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *key_cache.stride()[:3], layout.block_tables.stride(0),
        window or 1, (softcap or 1.0) * LOG2E,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=BLOCK_N[_kind(query)], BLOCK_D=block_d,
        NUM_SPLITS=splits, PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SOFTCAP=softcap is not None, WINDOWED=window is not None,
    )  # fmt: skip
    if splits > 1:
        _reduce_splits_kernel[(tiles.count, kv_heads)](
            out, part, stats, tiles.table, head_dim, out.stride(0), out.stride(1),
            GROUP=group, BLOCK_M=block_m, BLOCK_D=block_d, NUM_SPLITS=splits,
        )  # fmt: skip


def _kind(t: torch.Tensor) -> str:
    return "cuda" if t.is_cuda else "cpu"


def _last_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if (
        key_cache.shape != value_cache.shape
        or key_cache.stride() != value_cache.stride()
        or key_cache.stride(-1) != 1
    ):
        raise ValueError("paged attention: key and value caches must share one layout")
