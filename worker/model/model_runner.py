"""Turns a scheduled step into tensors, runs the model once, returns the logits to sample.

One flattened forward pass per step: decodes first (one token each), then prefill chunks.
The KV cache is allocated here once, as ``num_blocks * block_size`` slots per layer, on the
model's device; a step's index tensors are built on the host and copied there once. The
attention metadata is the torch path's (decode groups, chunks, native decodes) or, with
``attention_backend="triton"``, one ``PagedLayout`` for the Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from switchboard_kernels.attention_native import DTYPES as NATIVE_ATTENTION_DTYPES
from switchboard_kernels.attention_native import MAX_HEAD_DIM, NativeDecodes, native_attention
from switchboard_kernels.host_ints import flat_ints, host_ints, ragged_rows
from switchboard_kernels.paged_attention import AttentionMetadata, DecodeGroup, PrefillChunk
from switchboard_kernels.paged_layout import PagedLayout, PagedSequence
from worker.engine.batch import BlockMove, MoveKind, ScheduledSequence
from worker.model.cuda_graphs import DecodeGraphs
from worker.model.llama import LlamaModel
from worker.model.lora_manager import LoraBatch, LoraManager
from worker.model.model_config import ModelConfig


def kv_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, *, tensor_parallel_size: int = 1
) -> int:
    """Bytes one block takes across all layers (keys and values), on each rank: a rank of
    a tensor-parallel group holds its share of the KV heads."""
    kv_heads = config.num_kv_heads // tensor_parallel_size
    per_token = 2 * config.num_layers * kv_heads * config.head_dim
    return per_token * block_size * torch.tensor([], dtype=dtype).element_size()


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [num_sampling] rows of the flattened batch to sample from
    order: list[ScheduledSequence]  # the batch's sequences in flattened order

    def to(self, device: torch.device) -> StepInputs:
        """The same inputs with their tensors on ``device`` (``prepare`` makes them on the host)."""
        if device.type == "cpu":
            return self
        return StepInputs(
            input_ids=self.input_ids.to(device),
            positions=self.positions.to(device),
            meta=self.meta.to(device),
            logit_rows=self.logit_rows.to(device),
            order=self.order,
        )


def _offsets(s: ScheduledSequence) -> list[int]:
    """Each draft row's position offset past the real tokens fed (``Sequence.spec_offsets``)."""
    return s.seq.draft_offsets(s.num_spec)


def _plain(s: ScheduledSequence) -> bool:
    """Every draft row follows the one before: a chunk with the causal mask."""
    return _offsets(s) == list(range(s.num_spec))


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        *,
        num_blocks: int,
        block_size: int,
        lora_manager: LoraManager | None = None,
        num_host_blocks: int = 0,
        attention_backend: str = "torch",
        cuda_graphs: bool = False,
        max_num_seqs: int = 128,
        max_model_len: int = 2048,
    ) -> None:
        """``cuda_graphs``: replay decode steps as CUDA graphs (``worker.model.cuda_graphs``;
        CUDA and the triton backend only), their buffers sized by the last two."""
        self.model = model
        self.device = model.device
        self.lora_manager = lora_manager
        self.block_size = block_size
        self.triton_attention = attention_backend == "triton"
        c = model.config
        self.heads_per_kv_head = c.num_heads // c.num_kv_heads
        kv_heads = model.num_kv_heads  # this rank's, under tensor parallelism
        # Decodes read the cache in place where the native kernel serves (CPU, bf16 or fp32).
        self.native_decodes = (
            not self.triton_attention
            and self.device.type == "cpu"
            and model.dtype in NATIVE_ATTENTION_DTYPES
            and c.head_dim <= MAX_HEAD_DIM
            and native_attention() is not None
        )
        shape = (num_blocks, block_size, kv_heads, c.head_dim)
        self.kv_caches = [
            tuple(torch.zeros(shape, dtype=model.dtype, device=self.device) for _ in "kv")
            for _ in range(c.num_layers)
        ]
        # The swap pool: same layout in host memory (pinned when the cache is on a GPU).
        host_shape = (num_host_blocks, *shape[1:])
        pin = self.kv_caches[0][0].is_cuda
        self.host_caches = [
            (
                torch.zeros(host_shape, dtype=model.dtype, pin_memory=pin),
                torch.zeros(host_shape, dtype=model.dtype, pin_memory=pin),
            )
            for _ in range(c.num_layers if num_host_blocks else 0)
        ]
        # A draft model's small passes in one native call (None: the torch path only).
        self.native_pass = model.native_decode_pass(self.kv_caches)
        self.graphs = None
        if cuda_graphs:
            self.graphs = DecodeGraphs(
                model,
                self.kv_caches,
                max_batch=max_num_seqs,
                max_blocks=-(-max_model_len // block_size),
                block_size=block_size,
            )

    @torch.inference_mode()
    def move_blocks(self, moves: list[BlockMove]) -> None:
        """Make the scheduler's block moves in order, a run of moves of one kind at a time."""
        start = 0
        while start < len(moves):
            kind = moves[start].kind
            end = start + 1
            while end < len(moves) and moves[end].kind is kind:
                end += 1
            src = torch.tensor([m.src for m in moves[start:end]], dtype=torch.int64)
            dst = torch.tensor([m.dst for m in moves[start:end]], dtype=torch.int64)
            for layer, device in enumerate(self.kv_caches):
                host = self.host_caches[layer] if kind is not MoveKind.COPY else device
                source, target = (host, device) if kind is MoveKind.SWAP_IN else (device, host)
                for s, t in zip(source, target, strict=True):  # keys, then values
                    picked = s.index_select(0, src.to(s.device))  # [n, block, kv_heads, dim]
                    t.index_copy_(0, dst.to(t.device), picked.to(t.device))
            start = end

    @torch.inference_mode()
    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of cache slots ``src`` to slots ``dst``, every layer (a draft row
        kept whose slot is not its position's)."""
        src_index, dst_index = self._indices(src), self._indices(dst)
        for caches in self.kv_caches:
            for cache in caches:  # keys, then values
                flat = cache.view(-1, *cache.shape[2:])
                flat.index_copy_(0, dst_index, flat.index_select(0, src_index))

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledSequence], *, kept_only: bool = False
    ) -> tuple[list[ScheduledSequence], torch.Tensor]:
        """Run one step; returns the sampling sequences and their logits, one row per
        sampling sequence, or ``num_spec + 1`` consecutive rows for one verifying draft
        tokens: [sum of rows, vocab] (``kept_only``: a cut-down output layer's columns)."""
        native = self._execute_native(scheduled, kept_only)
        if native is not None:
            return native
        inputs = self.prepare(scheduled)
        lora = self.lora_batch(inputs)
        if self.graphs is not None and not kept_only and self.graphs.fits(inputs):
            logits = self.graphs.run(inputs, lora)
        else:
            logits = self.run(inputs.to(self.device), lora, kept_only=kept_only)
        assert logits is not None
        return [s for s in inputs.order if s.samples], logits

    def lora_batch(self, inputs: StepInputs) -> LoraBatch | None:
        """This step's adapters in slots and each token's slot; None when no sequence has one
        (the per-token list is only built then)."""
        if self.lora_manager is None or not any(s.seq.adapter_id for s in inputs.order):
            return None
        token_adapters = [a for s in inputs.order for a in [s.seq.adapter_id] * s.num_fed]
        return self.lora_manager.prepare(token_adapters, all_decode=inputs.meta.all_decode)

    def run(
        self, inputs: StepInputs, lora: LoraBatch | None, *, kept_only: bool = False
    ) -> torch.Tensor | None:
        """The forward pass over prepared inputs: the sampling rows' logits (None on a rank
        of a tensor-parallel group other than 0, which only lends its share of the pass)."""
        hidden = self.model.forward(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, lora
        )
        return self.model.compute_logits(hidden[inputs.logit_rows], kept_only=kept_only)

    def _execute_native(
        self, scheduled: list[ScheduledSequence], kept_only: bool
    ) -> tuple[list[ScheduledSequence], torch.Tensor] | None:
        """The step through ``native_pass`` if it fits one: sequences that each feed a few
        tokens (up to the pass's rows in all) and sample after them, no drafts to verify,
        no adapters; else None."""
        native = self.native_pass
        if (
            native is None
            or not scheduled
            or sum(s.num_tokens for s in scheduled) > native.max_rows
            or any(s.num_spec or not s.samples or s.seq.adapter_id for s in scheduled)
        ):
            return None
        logits = native(
            [
                (s.seq.tokens[s.start : s.start + s.num_tokens], s.start, s.seq.block_table)
                for s in scheduled
            ]
        )
        return list(scheduled), logits if kept_only else self.model.full_logits(logits)

    def prepare(self, scheduled: list[ScheduledSequence]) -> StepInputs:
        # Decodes (one real token, maybe draft tokens after it) sorted by tokens fed, then
        # context length, so that similar sequences share one attention call.
        decodes, prefills = [], []
        for s in scheduled:
            (decodes if self._is_decode(s) else prefills).append(s)
        decodes.sort(key=lambda s: (s.num_fed, s.start))
        order = decodes + prefills
        bs = self.block_size
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
        if self.triton_attention:
            meta = AttentionMetadata(slot_mapping, [], [], layout=self._layout(order))
        else:
            meta = AttentionMetadata(
                slot_mapping=slot_mapping,
                decode_groups=[] if self.native_decodes else self._decode_groups(decodes),
                prefills=self._prefill_chunks(prefills, start=sum(s.num_fed for s in decodes)),
                native_decodes=self._native_decodes(decodes)
                if self.native_decodes and decodes
                else None,
            )
        return StepInputs(
            input_ids=input_ids,
            positions=positions_t,
            meta=meta,
            logit_rows=logit_rows_t,
            order=order,
        )

    def _is_decode(self, s: ScheduledSequence) -> bool:
        """One real token past the prompt, plus any draft tokens to verify after it. Drafts
        laid out otherwise than one after another: the native kernel attends each such row
        as a sequence of its own; the torch path attends them as a chunk with a mask."""
        return (
            s.num_tokens == 1
            and s.start > 0
            and (self.native_decodes or not s.num_spec or _plain(s))
        )

    def _native_decodes(self, decodes: list[ScheduledSequence]) -> NativeDecodes:
        """The decodes for the native kernel: each sequence's real token and the draft rows
        that follow one another, then each other draft row as a one-query sequence over the
        same blocks, seeing the keys before its position and, at its position, itself (its
        own slot)."""
        bs = self.block_size
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

    def _layout(self, order: list[ScheduledSequence]) -> PagedLayout:
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
            sequences,
            num_kv_heads=self.model.num_kv_heads,
            group=self.heads_per_kv_head,
            device_type=self.device.type,
        )

    def _indices(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device)

    def _decode_groups(self, decodes: list[ScheduledSequence]) -> list[DecodeGroup]:
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
            groups.append(self._decode_group(decodes[start:end], row))
            row += (end - start) * first.num_fed
            start = end
        return groups

    def _decode_group(self, decodes: list[ScheduledSequence], start: int) -> DecodeGroup:
        """Block tables padded to the longest in the group and flattened; the causal mask."""
        # Every table covers the tokens fed this step; pad the shorter ones.
        tables = ragged_rows([s.seq.block_table for s in decodes], np.int64)
        span = tables.shape[1] * self.block_size
        queries = decodes[0].num_fed
        # Query i of a sequence (absolute position start + i) sees keys 0 .. start + i.
        last_key = torch.tensor([s.start for s in decodes], dtype=torch.int64)[:, None]
        last_key = last_key + torch.arange(queries)[None, :]  # [count, queries]
        mask = torch.arange(span)[None, None, :] <= last_key[:, :, None]  # [count, n, span]
        # Row g * queries + i of SDPA's query axis is query i (see paged_attention); one
        # query per sequence broadcasts over the heads.
        mask = mask.unsqueeze(1)
        if queries > 1:
            mask = mask.repeat(1, 1, self.heads_per_kv_head, 1)
        return DecodeGroup(
            start=start,
            count=len(decodes),
            queries=queries,
            block_tables=tables.view(-1),
            mask=mask,
        )

    def _prefill_chunks(
        self, prefills: list[ScheduledSequence], *, start: int
    ) -> list[PrefillChunk]:
        chunks = []
        for s in prefills:
            table = mask = None
            if s.start > 0:
                table = host_ints(s.seq.block_table)
                span = len(s.seq.block_table) * self.block_size
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
