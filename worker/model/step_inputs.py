"""A scheduled step flattened into one forward pass's inputs, built on the host.

Token ids, positions, the cache slot each row's K/V is written to, the rows whose logits are
sampled, and the attention metadata for the path that runs: the native decode kernel (CPU),
the torch path (decode groups gathered for SDPA, prefill chunks with masks) or one
``PagedLayout`` for the Triton kernels. Decodes come first, sorted so that similar ones share
an attention call; then prefill chunks. How long this takes bounds a GPU's tok/s
(``bench/host_step.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from switchboard_kernels.attention_native import NativeDecodes
from switchboard_kernels.host_ints import flat_ints, host_ints, ragged_rows
from switchboard_kernels.paged_attention import AttentionMetadata, DecodeGroup, PrefillChunk
from switchboard_kernels.paged_layout import PagedLayout, PagedSequence
from worker.core.batch import ScheduledSequence


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [num_sampling] rows of the flattened batch to sample from
    order: list[ScheduledSequence]  # the batch's sequences in flattened order
    # LongRoPE: each row's row of the RoPE tables (``LlamaModel.forward``); None: positions.
    rope_positions: torch.Tensor | None = None  # [num_tokens]

    def to(self, device: torch.device) -> StepInputs:
        """The same inputs with their tensors on ``device`` (``prepare_step`` makes them on the
        host)."""
        if device.type == "cpu":
            return self
        return StepInputs(
            input_ids=self.input_ids.to(device),
            positions=self.positions.to(device),
            meta=self.meta.to(device),
            logit_rows=self.logit_rows.to(device),
            order=self.order,
            rope_positions=None if self.rope_positions is None else self.rope_positions.to(device),
        )


def _offsets(s: ScheduledSequence) -> list[int]:
    """Each draft row's position offset past the real tokens fed (``Sequence.spec_offsets``)."""
    return s.seq.draft_offsets(s.num_spec)


def _plain(s: ScheduledSequence) -> bool:
    """Every draft row follows the one before: a chunk with the causal mask."""
    return _offsets(s) == list(range(s.num_spec))


def prepare_step(
    scheduled: list[ScheduledSequence],
    *,
    block_size: int,
    native_decodes: bool,
    triton_attention: bool,
    num_kv_heads: int,
    heads_per_kv_head: int,
    device_type: str,
    native_prefills: bool = False,
    native_chunk: Callable[[int], bool] | None = None,
) -> StepInputs:
    """``scheduled`` as one forward pass's host tensors: decodes first, then prefill chunks.
    The attention metadata is for the native decode kernel (``native_decodes``), the Triton
    kernels (``triton_attention``: this rank's ``num_kv_heads``, on ``device_type``) or the
    torch path (decode groups and chunks). ``native_prefills`` (with ``native_decodes``): the
    prefill chunks too go to the native kernel, each a sequence feeding many queries, so that
    every row attends in one order whatever the step holds (batch-invariant numerics).
    ``native_chunk`` (with ``native_decodes``): whether a prefill chunk of so many tokens
    (without draft rows) goes to the native kernel rather than SDPA (``op_choice``)."""
    # Decodes (one real token, maybe draft tokens after it) sorted by tokens fed, then
    # context length, so that similar sequences share one attention call; then the chunks
    # the native kernel takes, then SDPA's.
    decodes, prefills = [], []
    for s in scheduled:
        (decodes if _is_decode(s, native_decodes) else prefills).append(s)
    decodes.sort(key=lambda s: (s.num_fed, s.start))
    native_chunks = []
    if native_decodes and native_chunk is not None and not native_prefills:
        native_chunks = [s for s in prefills if not s.num_spec and native_chunk(s.num_fed)]
        if native_chunks:
            prefills = [s for s in prefills if s.num_spec or not native_chunk(s.num_fed)]
            decodes += native_chunks
    order = decodes + prefills
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logit_rows: list[int] = []
    for s in order:
        table = s.seq.block_table
        if s.num_tokens == 1 and not s.num_spec:
            # A plain decode, most of a busy step's rows: the general case below,
            # spelled out for one token (the host's work per step bounds a GPU's tok/s).
            p = s.start
            ids.append(s.seq.tokens[p])
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            if s.samples:
                logit_rows.append(len(ids) - 1)
            continue
        ids.extend(s.seq.tokens[s.start : s.start + s.num_tokens])
        ids.extend(s.seq.spec_token_ids[: s.num_spec])
        # Each row takes the next slot; a draft row takes its offset's position.
        span = range(s.start, s.start + s.num_fed)
        positions.extend(range(s.start, s.start + s.num_tokens))
        positions.extend(s.start + s.num_tokens + o for o in _offsets(s))
        slots.extend(table[p // bs] * bs + p % bs for p in span)
        if s.samples:
            # The last real token's row, then one row per draft token.
            logit_rows.extend(range(len(ids) - 1 - s.num_spec, len(ids)))
    slot_mapping, input_ids, positions_t, logit_rows_t = _host_columns(
        slots, ids, positions, logit_rows
    )
    if triton_attention:
        layout = _layout(order, num_kv_heads, heads_per_kv_head, device_type)
        meta = AttentionMetadata(slot_mapping, [], [], layout=layout)
    else:
        decode_start = sum(s.num_fed for s in decodes)
        if native_decodes and native_prefills:
            meta = AttentionMetadata(
                slot_mapping=slot_mapping,
                decode_groups=[],
                prefills=[],
                native_decodes=_native_decodes(order, block_size) if order else None,
                native_prefills=bool(prefills),
            )
        else:
            meta = AttentionMetadata(
                slot_mapping=slot_mapping,
                decode_groups=[]
                if native_decodes
                else _decode_groups(decodes, block_size, heads_per_kv_head),
                prefills=_prefill_chunks(prefills, decode_start, block_size),
                native_decodes=_native_decodes(decodes, block_size)
                if native_decodes and decodes
                else None,
                native_prefills=bool(native_chunks),
            )
    return StepInputs(
        input_ids=input_ids,
        positions=positions_t,
        meta=meta,
        logit_rows=logit_rows_t,
        order=order,
    )


def _is_decode(s: ScheduledSequence, native_decodes: bool) -> bool:
    """One real token past the prompt, plus any draft tokens to verify after it. Drafts
    laid out otherwise than one after another: the native kernel attends each such row
    as a sequence of its own; the torch path attends them as a chunk with a mask."""
    return s.num_tokens == 1 and s.start > 0 and (native_decodes or not s.num_spec or _plain(s))


def _native_decodes(decodes: list[ScheduledSequence], block_size: int) -> NativeDecodes:
    """The decodes for the native kernel: each sequence's real token and the draft rows
    that follow one another, then each other draft row as a one-query sequence over the
    same blocks, seeing the keys before its position and, at its position, itself (its
    own slot)."""
    bs = block_size
    starts, queries, tables, own_slots = [], [], [], []
    for s in decodes:
        table = s.seq.block_table
        if not s.num_spec:
            starts.append(s.start)
            queries.append(s.num_tokens)
            tables.append(table)
            own_slots.append(-1)
            continue
        offsets = _offsets(s)
        in_line = 0
        while in_line < len(offsets) and offsets[in_line] == in_line:
            in_line += 1
        starts.append(s.start)
        queries.append(s.num_tokens + in_line)
        tables.append(table)
        own_slots.append(-1)
        for j in range(in_line, len(offsets)):
            index = s.start + s.num_tokens + j
            starts.append(s.start + s.num_tokens + offsets[j])
            queries.append(1)
            tables.append(table)
            own_slots.append(table[index // bs] * bs + index % bs)
    return NativeDecodes.build(starts, queries, tables, own_slots)


def _layout(
    order: list[ScheduledSequence], num_kv_heads: int, group: int, device_type: str
) -> PagedLayout:
    """The step for the Triton kernels: every sequence by its rows, context and table;
    draft rows off their chain see their chain's keys, then themselves."""
    sequences = []
    for s in order:
        last = None
        if s.num_spec and not _plain(s):
            real = range(s.start, s.start + s.num_tokens)
            last = [*real, *(s.start + s.num_tokens + o - 1 for o in _offsets(s))]
        sequences.append(PagedSequence(s.start, s.num_fed, s.seq.block_table, last))
    return PagedLayout.build(
        sequences, num_kv_heads=num_kv_heads, group=group, device_type=device_type
    )


def _decode_groups(
    decodes: list[ScheduledSequence], block_size: int, heads_per_kv_head: int
) -> list[DecodeGroup]:
    """Split sorted decodes where the tokens fed differ, or where padding to the group's
    longest would exceed ~25% (plus two blocks) of the shortest one's blocks."""
    groups: list[DecodeGroup] = []
    start = row = 0
    while start < len(decodes):
        first = decodes[start]
        first_blocks = len(first.seq.block_table)
        end = start + 1
        while (
            end < len(decodes)
            and decodes[end].num_fed == first.num_fed
            and len(decodes[end].seq.block_table) <= first_blocks * 1.25 + 2
        ):
            end += 1
        groups.append(_decode_group(decodes[start:end], row, block_size, heads_per_kv_head))
        row += (end - start) * first.num_fed
        start = end
    return groups


def _decode_group(
    decodes: list[ScheduledSequence], start: int, block_size: int, heads_per_kv_head: int
) -> DecodeGroup:
    """Block tables padded to the longest in the group and flattened; the causal mask."""
    # Every table covers the tokens fed this step; pad the shorter ones.
    tables = ragged_rows([s.seq.block_table for s in decodes], np.int64)
    span = tables.shape[1] * block_size
    queries = decodes[0].num_fed
    # Query i of a sequence (absolute position start + i) sees keys 0 .. start + i.
    last_key = torch.tensor([s.start for s in decodes], dtype=torch.int64)[:, None]
    last_key = last_key + torch.arange(queries)[None, :]  # [count, queries]
    mask = torch.arange(span)[None, None, :] <= last_key[:, :, None]  # [count, n, span]
    # Row g * queries + i of SDPA's query axis is query i (see paged_attention); one
    # query per sequence broadcasts over the heads.
    mask = mask.unsqueeze(1)
    if queries > 1:
        mask = mask.repeat(1, 1, heads_per_kv_head, 1)
    return DecodeGroup(
        start=start,
        count=len(decodes),
        queries=queries,
        block_tables=tables.view(-1),
        mask=mask,
    )


def _prefill_chunks(
    prefills: list[ScheduledSequence], start: int, block_size: int
) -> list[PrefillChunk]:
    """The torch path's prefill chunks from row ``start``; one with cached context before it
    gets its block table and mask."""
    chunks = []
    for s in prefills:
        table = mask = None
        if s.start > 0:
            table = host_ints(s.seq.block_table)
            span = len(s.seq.block_table) * block_size
            mask = _chunk_mask(s, span)
        chunks.append(PrefillChunk(start, s.num_fed, s.start, table, mask))
        start += s.num_fed
    return chunks


def _host_columns(*columns: list[int]) -> tuple[torch.Tensor, ...]:
    """Each list as an int64 host tensor, cut from one (each conversion costs more than a
    step's worth of values)."""
    lengths = [len(column) for column in columns]
    return flat_ints(columns, sum(lengths)).split(lengths)


def _chunk_mask(s: ScheduledSequence, span: int) -> torch.Tensor:
    """[rows fed, span] bool: which cache slots each row of a chunk attends to.

    Row i (slot start + i) sees slots 0..start + i. A draft row at offset o sees the slots
    up to start + num_tokens + o - 1 and itself (for drafts one after another, the same)."""
    slot = torch.arange(s.start, s.start + s.num_fed).unsqueeze(1)  # [rows, 1]
    keys = torch.arange(span).unsqueeze(0)  # [1, span]
    if _plain(s):
        return keys <= slot
    last_seen = slot.clone()
    last_seen[s.num_tokens :, 0] = torch.tensor(_offsets(s)) + s.start + s.num_tokens - 1
    return (keys <= last_seen) | (keys == slot)
