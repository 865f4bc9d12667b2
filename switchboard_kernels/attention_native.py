"""The native CPU decode attention (``switchboard_kernels/attention_cpu.c``): metadata and call.

Built and loaded by ``switchboard_kernels/native.py``; ``native_attention()`` is None where it
cannot be, and the model runner then plans the torch path's padded decode groups instead.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from switchboard_kernels import native
from switchboard_kernels.host_ints import flat_ints

MAX_HEAD_DIM = 256  # as in attention_cpu.c
DTYPES = (torch.bfloat16, torch.float32)  # of the query, output and cache
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@dataclass(slots=True)
class NativeDecodes:
    """The step's decoding sequences as the kernel reads them (host int64 tensors)."""

    rows: torch.Tensor  # [S]: each sequence's first row in the flattened batch
    queries: torch.Tensor  # [S]: rows fed (1, or k + 1 verifying k drafts)
    starts: torch.Tensor  # [S]: tokens cached before this step; query i sees start + i + 1
    table_starts: torch.Tensor  # [S]: offset of each sequence's table in ``tables``
    tables: torch.Tensor  # [sum of blocks]: the block tables back to back, unpadded
    # [S]: -1, or for a one-query sequence the flat cache slot of its own key and value
    # (key ``start``), read there instead of through the table: an alternative draft.
    own_slots: torch.Tensor
    count: int
    end_row: int  # one past the last row
    max_block: int  # largest block id (checked against the cache)
    max_own_slot: int  # largest own slot, -1 if none (checked against the cache)

    @classmethod
    def build(
        cls,
        starts: Sequence[int],
        queries: Sequence[int],
        tables: Sequence[Sequence[int]],
        own_slots: Sequence[int] | None = None,
    ) -> NativeDecodes:
        """Sequences in batch order from row 0, each with its start, rows fed and blocks
        (which must cover start + rows fed tokens), and its own slot or -1 (default)."""
        rows, table_starts = [], []
        row = blocks = 0
        for n, table in zip(queries, tables, strict=True):
            rows.append(row)
            table_starts.append(blocks)
            blocks += len(table)
            row += n
        own = list(own_slots) if own_slots is not None else [-1] * len(rows)
        if len(own) != len(rows) or any(
            s >= 0 and n != 1 for s, n in zip(own, queries, strict=True)
        ):
            raise ValueError("own slots: one per sequence, and only for one-query sequences")

        # One host tensor cut in six: each conversion costs more than its values.
        fields = [rows, queries, starts, table_starts, own]
        lengths = [len(f) for f in fields] + [blocks]
        parts = flat_ints([*fields, *tables], sum(lengths)).split(lengths)
        return cls(
            rows=parts[0],
            queries=parts[1],
            starts=parts[2],
            table_starts=parts[3],
            own_slots=parts[4],
            tables=parts[5],
            count=len(rows),
            end_row=row,
            max_block=int(parts[5].max()) if blocks else -1,
            max_own_slot=max(own, default=-1),
        )


class NativeAttention:
    """The loaded kernel. ``has_avx512``: the vector loops are in (else plain C only)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._decode = lib.sb_paged_decode_windowed
        self._decode.restype = ctypes.c_int
        self._decode.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr]
        self._decode.argtypes += [_i64] * 5 + [_ptr] * 6 + [ctypes.c_float] + [ctypes.c_int] * 2
        self._decode.argtypes += [_i64, ctypes.c_float]
        self.has_avx512 = bool(lib.sb_attention_has_avx512())
        # The plain kernel's address, for native code that calls it (draft_cpu.c).
        self.address = ctypes.cast(lib.sb_paged_decode, ctypes.c_void_p).value

    def decode(
        self,
        query: torch.Tensor,  # [T, heads, head_dim] bf16 or fp32, as are the three below
        out: torch.Tensor,  # [T, heads, head_dim], rows of the decodes written
        key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        value_cache: torch.Tensor,
        decodes: NativeDecodes,
        scale: float,
        *,
        portable: bool = False,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """Semantics: ``out[r, h] = softmax(scale * q[r, h] · K[:len]) · V[:len]`` per decode
        query, ``len = start + i + 1``, key ``start`` of a sequence with an own slot read
        from that slot (see switchboard_kernels/attention_cpu.c). With a ``window`` W only the
        keys ``len - W ..`` are seen; with a ``softcap`` the scores s become
        ``softcap * tanh(s / softcap)`` before the softmax."""
        num_blocks, block_size, kv_heads, head_dim = key_cache.shape
        tensors = (query, out, key_cache, value_cache)
        if (
            key_cache.dtype not in DTYPES
            or any(t.dtype != key_cache.dtype or t.stride(-1) != 1 for t in tensors)
            or not (key_cache.is_contiguous() and value_cache.shape == key_cache.shape)
            or not value_cache.is_contiguous()
            or query.shape != out.shape
            or query.shape[2] != head_dim
            or head_dim > MAX_HEAD_DIM
            or query.shape[1] % kv_heads
            or decodes.end_row > query.shape[0]
            or decodes.max_block >= num_blocks
            or decodes.max_own_slot >= num_blocks * block_size
            or (window is not None and window < 1)
            or (softcap is not None and not softcap > 0)
        ):
            raise ValueError(
                f"native attention: query {tuple(query.shape)} {query.dtype}, cache "
                f"{tuple(key_cache.shape)} {key_cache.dtype} and the decodes do not fit together"
            )
        if decodes.count == 0:
            return
        status = self._decode(
            query.data_ptr(),
            query.stride(0),
            query.stride(1),
            out.data_ptr(),
            out.stride(0),
            out.stride(1),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_size,
            query.shape[1],
            kv_heads,
            head_dim,
            decodes.count,
            decodes.rows.data_ptr(),
            decodes.queries.data_ptr(),
            decodes.starts.data_ptr(),
            decodes.table_starts.data_ptr(),
            decodes.tables.data_ptr(),
            decodes.own_slots.data_ptr(),
            scale,
            int(key_cache.dtype == torch.float32),
            int(portable),
            window or 0,
            softcap or 0.0,
        )
        if status != 0:
            raise MemoryError("native attention: scratch allocation failed")


@functools.cache
def native_attention() -> NativeAttention | None:
    """The kernel, built on first use; None where it cannot be (reason logged once)."""
    lib = native.load("attention_cpu.c")
    return None if lib is None else NativeAttention(lib)
