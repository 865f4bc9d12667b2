"""Decode steps replayed as CUDA graphs: the whole forward pass in one launch.

A decode step runs the same kernels at every step of one batch size, and launching them
from Python costs the host more than a small model's step costs the GPU. So for each
bucketed batch size the runner captures the forward pass and the logits once, over static
input buffers; later steps copy their inputs into those buffers and replay. Rows past the
batch are padding: slot -1 (no K/V written), an empty attention tile, no adapter.

Only steps a graph runs exactly take it: every sequence feeds one token and samples it,
on the Triton attention backend (its split-K fixed per bucket), on one rank. LoRA runs
inside the graph as BGMV over a static per-token slot buffer; adapters are loaded into
slots outside it, in place, so a graph sees them. A LoRA group that no adapter targets is
skipped when captured, so graphs are keyed by the groups in use, and recaptured when that
set grows. ``capture=False`` runs the same padded pass without capturing (to test the
padding where there is no GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from switchboard_kernels.host_ints import host_ints
from switchboard_kernels.lora import LoraMapping
from switchboard_kernels.paged_attention import AttentionMetadata
from switchboard_kernels.paged_layout import PagedLayout, Tiles, choose_splits
from worker.model.lora_manager import LoraBatch

if TYPE_CHECKING:
    from worker.model.llama import LlamaModel
    from worker.model.step_inputs import StepInputs

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


def bucket_for(batch: int) -> int | None:
    """The smallest bucket holding ``batch`` sequences (None past the largest)."""
    return next((b for b in BUCKETS if b >= batch), None)


@dataclass(slots=True)
class _Graph:
    replay: Callable[[], None] | None
    logits: torch.Tensor  # [bucket, vocab], written by each replay


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        max_batch: int,
        max_blocks: int,  # block table width a sequence can reach
        block_size: int,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.capture = capture
        self.block_size = block_size
        self.max_batch = bucket_for(max_batch) or BUCKETS[-1]
        b, device = self.max_batch, model.device

        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        # Static inputs: each step's rows copied to the front, padding behind them.
        self.input_ids = zeros(b, dtype=torch.int64)
        self.positions = zeros(b, dtype=torch.int64)
        self.slot_mapping = zeros(b, dtype=torch.int64)
        self.token_slots = zeros(b, dtype=torch.int64)  # LoRA slot per row, -1 = none
        self.block_tables = zeros(b, max_blocks)
        self.row_keys = zeros(b)  # a decode row sees keys 0..its own: row_last = row_self
        self.tiles = zeros(b, 4)  # (sequence, row, rows, keys): sequence i is row i
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.num_replays = 0

    def fits(self, inputs: StepInputs) -> bool:
        """One row per sequence, every row sampled, within the buffers."""
        layout = inputs.meta.layout
        if layout is None or layout.prefill.count or layout.decode.block_q != 1:
            return False
        rows = layout.row_self.shape[0]
        return (
            rows <= self.max_batch
            and inputs.logit_rows.shape[0] == rows
            and layout.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(self, inputs: StepInputs, lora: LoraBatch | None) -> torch.Tensor:
        """The step's logits [rows, vocab] by replaying (capturing first if need be)."""
        layout = inputs.meta.layout
        assert layout is not None
        rows = layout.row_self.shape[0]
        bucket = bucket_for(rows)
        assert bucket is not None
        self._stage(inputs, layout, lora, rows, bucket)
        key = (bucket, None if lora is None else tuple(
            s.used for stacks in lora.stacks for s in stacks.values()
        ))  # fmt: skip
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(bucket, lora)
        assert graph.replay is not None
        graph.replay()
        self.num_replays += 1
        return graph.logits[:rows].clone()

    def _stage(
        self,
        inputs: StepInputs,
        layout: PagedLayout,
        lora: LoraBatch | None,
        rows: int,
        bucket: int,
    ) -> None:
        """Copy the step's rows in; reset the padding rows up to the bucket."""
        pad = bucket - rows

        def padded(values: torch.Tensor, fill: int) -> torch.Tensor:
            return torch.cat([values, values.new_full((pad, *values.shape[1:]), fill)])

        self.input_ids[:bucket].copy_(padded(inputs.input_ids, 0))
        self.positions[:bucket].copy_(padded(inputs.positions, 0))
        self.slot_mapping[:bucket].copy_(padded(inputs.meta.slot_mapping, -1))
        self.row_keys[:bucket].copy_(padded(layout.row_self, 0))
        tiles = padded(layout.decode.table, 0)
        tiles[rows:, 1] = torch.arange(rows, bucket, dtype=tiles.dtype)
        self.tiles[:bucket].copy_(tiles)
        width = layout.block_tables.shape[1]
        self.block_tables[:rows, :width].copy_(layout.block_tables)
        if lora is not None:
            slots = host_ints(lora.token_slots)
            self.token_slots[:bucket].copy_(padded(slots, -1))

    def _capture(self, bucket: int, lora: LoraBatch | None) -> _Graph:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            decode_groups=[],
            prefills=[],
            layout=self._layout(bucket),
        )
        static_lora = None
        if lora is not None:
            mapping = LoraMapping(
                token_slots=self.token_slots[:bucket],
                seg_starts=self.token_slots[:2],  # unread: BGMV reads token_slots only
                seg_slots=self.token_slots[:1],
                max_seg_len=1,
                any_lora=True,
                all_decode=True,
                cpu=None,
            )
            static_lora = LoraBatch(mapping, lora.stacks, [])

        def forward() -> torch.Tensor:
            hidden = self.model.forward(
                self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, meta, static_lora
            )
            return self.model.compute_logits(hidden)

        if not self.capture:
            eager = _Graph(replay=None, logits=self.input_ids[:0])

            def rerun() -> None:
                eager.logits = forward()

            eager.replay = rerun
            return eager
        # Warm up (compiles the kernels) on a side stream, as capture requires; the staged
        # inputs are this step's, so the K/V it writes are the ones the replay writes.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = forward()
        return _Graph(replay=graph.replay, logits=logits)

    def _layout(self, bucket: int) -> PagedLayout:
        """The static layout of a bucket: one single-row tile per sequence, padding tiles
        empty, split-K fixed for the longest context a sequence can reach."""
        longest = self.block_tables.shape[1] * self.block_size
        splits = choose_splits(longest, bucket * self.model.num_kv_heads)
        no_tiles = self.tiles[:0]
        return PagedLayout(
            block_tables=self.block_tables[:bucket],
            row_last=self.row_keys[:bucket],
            row_self=self.row_keys[:bucket],
            decode=Tiles(self.tiles[:bucket], block_q=1, num_splits=splits),
            prefill=Tiles(no_tiles, block_q=1, num_splits=1),
        )
