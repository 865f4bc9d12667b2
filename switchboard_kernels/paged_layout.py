"""A step's sequences as the Triton paged-attention kernels read them (``PagedLayout``).

Every sequence, decode or prefill chunk, is described the same way: its rows in the
flattened batch, its block table, and per row the keys it sees: the run ``0..last`` plus
its own key ``self`` (``self == last`` for causal rows; a draft row laid out off the chain
sees its chain up to ``last`` and itself). Keys are positions in the sequence, reached
through the block table; the step's fresh keys are already written when attention runs.

The work is cut into tiles, each a run of query rows of one sequence handled by one
program per KV head (and per split of the keys): short sequences (decodes, k + 1
verification rows) in the decode launch, which may split long contexts (flash-decoding);
longer chunks in the prefill launch, ``block_q`` rows a tile. Tiles carry the number of
keys they read, so a tile of zero rows (padding in a captured CUDA graph) does nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from switchboard_kernels.host_ints import host_ints, ragged_rows

# Sequences of up to this many rows go to the decode launch (a plain decode, or k + 1
# verification rows for k <= 7); longer chunks are tiled by the prefill launch.
DECODE_MAX_ROWS = 8
# Rows of a program's query tile, counting each query head of a KV head as a row.
PREFILL_TILE_ROWS = {"cuda": 64, "cpu": 16}
# Split-K for decodes: keys a split should at least read, and the most splits.
SPLIT_MIN_KEYS = 256
MAX_SPLITS = 16
# Decode programs (tiles x KV heads) that already fill a GPU without splitting.
ENOUGH_PROGRAMS = 256


@dataclass(slots=True)
class PagedSequence:
    """One sequence of the step: ``context`` tokens cached before it, ``rows`` fed now."""

    context: int
    rows: int
    block_table: Sequence[int]  # covers context + rows tokens
    # Per row, the last key of the run it sees (None: causal, row i sees context + i).
    last_keys: Sequence[int] | None = None


@dataclass(slots=True)
class Tiles:
    """One launch: ``table[t] = (sequence, first row, rows, keys read)`` (int32 [T, 4])."""

    table: torch.Tensor
    block_q: int  # query rows per tile, a power of two
    num_splits: int  # programs per tile and KV head over the keys (1: no split-K)

    @property
    def count(self) -> int:
        return self.table.shape[0]

    def to(self, device: torch.device) -> Tiles:
        return Tiles(self.table.to(device), self.block_q, self.num_splits)


@dataclass(slots=True)
class PagedLayout:
    """The step's rows, block tables and tiles, as the Triton kernels read them."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with block 0
    row_last: torch.Tensor  # [num_rows] int32: row r sees keys 0..row_last[r]
    row_self: torch.Tensor  # [num_rows] int32: and key row_self[r], its own
    decode: Tiles
    prefill: Tiles

    def to(self, device: torch.device) -> PagedLayout:
        return PagedLayout(
            self.block_tables.to(device),
            self.row_last.to(device),
            self.row_self.to(device),
            self.decode.to(device),
            self.prefill.to(device),
        )

    @classmethod
    def build(
        cls,
        sequences: Sequence[PagedSequence],
        *,
        num_kv_heads: int,
        group: int,  # query heads per KV head
        device_type: str = "cuda",
        num_splits: int | None = None,  # None: chosen from the longest decode context
    ) -> PagedLayout:
        """The layout of ``sequences``, laid out back to back from row 0."""
        tables: list[Sequence[int]] = []
        row_last: list[int] = []
        row_self: list[int] = []
        decodes: list[tuple[int, int, int, int]] = []
        prefills: list[tuple[int, int, int, int]] = []
        prefill_q = prefill_block_q(group, device_type)
        decode_q = 1
        row = 0
        for index, s in enumerate(sequences):
            own = range(s.context, s.context + s.rows)
            last = own if s.last_keys is None else s.last_keys
            if len(last) != s.rows or (
                s.last_keys is not None and any(k > o for k, o in zip(last, own, strict=True))
            ):
                raise ValueError("last_keys: one per row, none past the row's own key")
            row_last.extend(last)
            row_self.extend(own)
            tables.append(s.block_table)
            if s.rows <= DECODE_MAX_ROWS:
                decodes.append((index, row, s.rows, s.context + s.rows))
                decode_q = max(decode_q, s.rows)
            else:
                for first in range(0, s.rows, prefill_q):
                    rows = min(prefill_q, s.rows - first)
                    # Own keys grow with the row and no row sees past its own key.
                    prefills.append((index, row + first, rows, s.context + first + rows))
            row += s.rows
        if num_splits is None:
            longest = max((t[3] for t in decodes), default=0)
            num_splits = choose_splits(longest, len(decodes) * num_kv_heads)
        return cls(
            block_tables=ragged_rows(tables),
            row_last=_int32(row_last),
            row_self=_int32(row_self),
            decode=_tiles(decodes, _pow2(decode_q), num_splits),
            prefill=_tiles(prefills, prefill_q, 1),
        )


def prefill_block_q(group: int, device_type: str) -> int:
    """Query rows per prefill tile: the largest power of two whose heads fit the tile."""
    rows = max(1, PREFILL_TILE_ROWS.get(device_type, PREFILL_TILE_ROWS["cuda"]) // group)
    return 1 << (rows.bit_length() - 1)


def choose_splits(longest: int, programs: int) -> int:
    """Split-K for long contexts when the decode programs alone leave the GPU idle."""
    if programs >= ENOUGH_PROGRAMS:
        return 1
    return max(1, min(MAX_SPLITS, longest // SPLIT_MIN_KEYS))


def _tiles(rows: list[tuple[int, int, int, int]], block_q: int, num_splits: int) -> Tiles:
    return Tiles(_int32([v for t in rows for v in t]).view(len(rows), 4), block_q, num_splits)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _int32(values: list[int]) -> torch.Tensor:
    return host_ints(values, np.int32)
