"""The native CPU multi-LoRA kernel (``switchboard_kernels/lora_cpu.c``): lay out, group, call.

Built and loaded by ``switchboard_kernels/native.py``; ``native_library()`` is None where it cannot
be, and the LoRA manager then keeps the torch paths' forms instead.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from switchboard_kernels import native
from switchboard_kernels.lora_dora import DoraScales, check_dora

MAX_BLOCKS = 3  # as in lora_cpu.c: a fused group of at most three projections (q/k/v)
DTYPES = (torch.bfloat16, torch.float32)  # of x, y and the slots' weights
SLOT_FIELDS = 3 + 5 * MAX_BLOCKS

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class NativeLora:
    """The loaded kernel. ``has_avx512``: the vector loops are in (else plain C only)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._bgmv = lib.sb_lora_bgmv
        self._bgmv.restype = ctypes.c_int
        self._bgmv.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64]
        self._bgmv.argtypes += [_ptr, _ptr, _ptr, ctypes.c_int, ctypes.c_int]
        self.has_avx512 = bool(lib.sb_lora_has_avx512())
        # For native code that calls it (decode_step_cpu.c).
        self.bgmv_address = ctypes.cast(lib.sb_lora_bgmv, ctypes.c_void_p).value
        self._dora = lib.sb_lora_dora
        self._dora.restype = None
        self._dora.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr]
        self._dora.argtypes += [ctypes.c_int]

    def dora(
        self,
        y: torch.Tensor,  # [T, >= out] bf16 or fp32, updated in place
        dora: DoraScales,  # on the host
        groups: NativeGroups,
        base: torch.Tensor | None = None,  # [out] or [T, out], y's dtype
    ) -> None:
        """Semantics: ``y[t, :out] = z_t + scales[s] * (y[t, :out] - z_t)`` for the rows of
        the groups whose slot s has DoRA (``switchboard_kernels/lora_dora.py``)."""
        check_dora(y, dora, base)
        if (
            y.dtype not in DTYPES
            or y.stride(1) != 1
            or not dora.scales.is_contiguous()
            or dora.enabled.dtype != torch.int64
            or (base is not None and base.stride(-1) != 1)
            or groups.max_slot >= dora.scales.shape[0]
            or groups.end > y.shape[0]
        ):
            raise ValueError(
                f"native DoRA: y {y.dtype} {tuple(y.shape)}, scales "
                f"{tuple(dora.scales.shape)} and the groups do not fit together"
            )
        base_stride = 0 if base is None or base.dim() == 1 else base.stride(0)
        self._dora(
            y.data_ptr(),
            y.stride(0),
            dora.out_features,
            dora.scales.data_ptr(),
            dora.enabled.data_ptr(),
            None if base is None else base.data_ptr(),
            base_stride,
            groups.num_groups,
            groups.slots.data_ptr(),
            groups.starts.data_ptr(),
            groups.rows.data_ptr(),
            int(y.dtype == torch.float32),
        )

    def bgmv(
        self,
        y: torch.Tensor,  # [T, out_total] bf16 or fp32 (as x and the slots), updated in place
        x: torch.Tensor,  # [T, in]
        slots: NativeSlots,  # the stacks' slots in the kernel's layout
        scales: torch.Tensor,  # [S] float32
        groups: NativeGroups,
        out_offset: int = 0,
        *,
        portable: bool = False,
        table: torch.Tensor | None = None,
    ) -> None:
        """Semantics: ``y[t, o:] += scales[s] * x[t] @ A_s.T @ B_s.T`` for the groups' tokens.

        ``table``: rows of ``slots.table`` to read instead of it (a mix's virtual slots: row j
        points at a real slot's weights, ``scales[j]`` its scale times a weight)."""
        table = slots.table if table is None else table
        if x.stride(1) != 1 or y.stride(1) != 1 or not x.dtype == y.dtype == slots.dtype:
            raise ValueError(
                f"native LoRA: x ({x.dtype}) and y ({y.dtype}) must have contiguous rows and "
                f"the slots' dtype ({slots.dtype})"
            )
        if scales.dtype != torch.float32 or not scales.is_contiguous():
            raise ValueError("native LoRA: scales must be contiguous float32")
        if (
            groups.max_slot >= table.shape[0]
            or scales.shape[0] < table.shape[0]
            or groups.end > min(x.shape[0], y.shape[0])
            or x.shape[1] != slots.in_features
            or out_offset + slots.out_features > y.shape[1]
        ):
            raise ValueError(
                f"native LoRA: x {tuple(x.shape)}, y {tuple(y.shape)} at column {out_offset} "
                f"and slots [{table.shape[0]}, {slots.in_features} -> "
                f"{slots.out_features}] do not fit together"
            )
        status = self._bgmv(
            x.data_ptr(),
            x.stride(0),
            x.shape[1],
            y.data_ptr() + out_offset * y.element_size(),
            y.stride(0),
            table.data_ptr(),  # valid while ``slots`` holds the buffers it points at
            scales.data_ptr(),
            groups.num_groups,
            groups.slots.data_ptr(),
            groups.starts.data_ptr(),
            groups.rows.data_ptr(),
            int(x.dtype == torch.float32),
            int(portable),
        )
        if status != 0:
            raise MemoryError("native LoRA: scratch allocation failed")


@dataclass(slots=True)
class NativeGroups:
    """A step's tokens grouped by adapter slot, as the kernel reads them (host tensors)."""

    slots: torch.Tensor  # [G] int64: each group's slot
    starts: torch.Tensor  # [G + 1] int64: group g is rows[starts[g]:starts[g + 1]]
    rows: torch.Tensor  # [N] int64: token rows, grouped
    num_groups: int
    max_slot: int  # -1 when empty; checked against the table before each call
    end: int  # one past the last row: the batch must hold this many tokens

    @classmethod
    def from_runs(cls, runs: Sequence[tuple[int, int, int]]) -> NativeGroups:
        """From (start, end, slot) runs; runs of one slot join one group (weights read
        once); runs of slot -1 (no adapter) are left out."""
        by_slot: dict[int, list[int]] = {}
        for start, end, slot in runs:
            if slot >= 0:
                by_slot.setdefault(slot, []).extend(range(start, end))
        starts = [0]
        for rows in by_slot.values():
            starts.append(starts[-1] + len(rows))
        return cls(
            slots=torch.tensor(list(by_slot), dtype=torch.int64),
            starts=torch.tensor(starts, dtype=torch.int64),
            rows=torch.tensor([r for rows in by_slot.values() for r in rows], dtype=torch.int64),
            num_groups=len(by_slot),
            max_slot=max(by_slot, default=-1),
            end=max((end for start, end, slot in runs if slot >= 0), default=0),
        )


class NativeSlots:
    """Each slot's A and B of one stack in the kernel's layout, and the pointer table.

    ``blocks``: the stack's fused projections as (out_begin, out_end) output ranges; the
    stack's rank columns split evenly among them (module m owns rank rows m*R .. m*R+R).
    A slot is cut to the rank rows its adapter fills (the rest are zero, so exact), and B's
    block of each projection is kept transposed without the block diagonal's zeros.
    """

    __slots__ = ("_virtual", "blocks", "dtype", "held", "in_features", "out_features", "table")

    @staticmethod
    def wanted(a_stack: torch.Tensor) -> bool:
        """bf16 or fp32 stacks on CPU, where the kernel builds."""
        return (
            a_stack.device.type == "cpu"
            and a_stack.dtype in DTYPES
            and native_library() is not None
        )

    def __init__(
        self,
        num_slots: int,
        in_features: int,
        blocks: Sequence[tuple[int, int]],
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"native LoRA: slots of {dtype}; the kernel takes {DTYPES}")
        self.dtype = dtype
        if not 1 <= len(blocks) <= MAX_BLOCKS:
            raise ValueError(f"native LoRA: 1 to {MAX_BLOCKS} projections per group")
        self.blocks = list(blocks)
        self.in_features = in_features
        self.out_features = max(end for _, end in blocks)
        self.table = torch.zeros(num_slots, SLOT_FIELDS, dtype=torch.int64)
        self.held: list[list[torch.Tensor]] = [[] for _ in range(num_slots)]  # keeps pointers valid
        # A mix's virtual slots, by (real slots, weights): (table rows, scales); see ``virtual``.
        self._virtual: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def virtual(
        self, key: tuple, sources: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Virtual slots j: table row ``sources[j]``, scale ``scales[sources[j]] * weights[j]``;
        kept until a slot is refreshed (``scales`` is the stack's, which changes only with its
        slots), so steps of a running mix build them once. ``key``: (sources, weights) as tuples.
        """
        hit = self._virtual.get(key)
        if hit is None:
            if len(self._virtual) >= 64:
                self._virtual.clear()
            table = self.table.index_select(0, sources)
            hit = self._virtual[key] = (table, scales.index_select(0, sources).mul_(weights))
        return hit

    def refresh(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Rebuild ``slot`` from its padded A [M*R, in] and B [out_total, M*R]."""
        rank_per_block = a.shape[0] // len(self.blocks)
        keep = a.ne(0).any(dim=1).nonzero().squeeze(1).tolist()
        self._virtual.clear()
        row = self.table[slot]
        row.zero_()
        self.held[slot] = []
        if not keep:  # rank 0: the kernel skips the slot
            return
        parts, fields = [a[keep].reshape(-1)], []
        offset = parts[0].numel()
        for m, (out_begin, out_end) in enumerate(self.blocks):
            own = [i for i, k in enumerate(keep) if k // rank_per_block == m]
            if not own:
                continue
            bt = b[out_begin:out_end, [keep[i] for i in own]].T  # [r_m, out_m]
            pad = -(out_end - out_begin) % 16
            tiles = F.pad(bt, (0, pad)).reshape(len(own), -1, 16).transpose(0, 1)  # [C, r_m, 16]
            fields.append((own[0], own[-1] + 1, out_begin, out_end, offset))
            parts.append(tiles.reshape(-1))
            offset += parts[-1].numel()
        buffer = torch.cat(parts).to(self.dtype)  # one stream per work item
        base, size = buffer.data_ptr(), buffer.element_size()
        row[0], row[1], row[2] = base, len(keep), len(fields)
        for n, (*span, start) in enumerate(fields):
            row[3 + 5 * n : 8 + 5 * n] = torch.tensor([*span, base + start * size])
        self.held[slot] = [buffer]


@functools.cache
def native_library() -> NativeLora | None:
    """The kernel, built on first use; None where it cannot be (reason logged once)."""
    lib = native.load("lora_cpu.c")
    return None if lib is None else NativeLora(lib)
