"""RoPE in place over a step's fused q/k rows (``rope_cpu.c``), bit for bit
``worker.model.rope.apply_rope``. Built and loaded by ``switchboard_kernels/native.py``;
``native_rope()`` is None where it cannot be, and the model then uses the torch ops."""

from __future__ import annotations

import ctypes
import functools

import torch

from switchboard_kernels import native

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class NativeRope:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._rotate = lib.sb_rope_rows
        self._rotate.restype = None
        self._rotate.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, ctypes.c_int]

    def rotate_(
        self,
        x: torch.Tensor,  # [rows, >= heads * head_dim]: the heads to turn lead each row
        heads: int,
        head_dim: int,
        positions: torch.Tensor,  # [rows] int64, each < the tables' rows
        cos: torch.Tensor,  # [positions, head_dim], x's dtype
        signed_sin: torch.Tensor,
        *,
        positions_checked: bool = False,
    ) -> None:
        """Semantics: ``x[:, :heads * head_dim]`` viewed [rows, heads, head_dim] becomes
        ``apply_rope(it, cos[positions, None], signed_sin[positions, None])``, in place.
        ``positions_checked``: the caller has checked them against the tables
        (``check_positions``; a model checks once a forward pass, not once a layer)."""
        rows = x.shape[0]
        ok = (
            x.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float32)
            and x.stride(1) == 1
            and x.shape[1] >= heads * head_dim
            and head_dim % 2 == 0
            and cos.dtype == signed_sin.dtype == x.dtype
            and cos.shape == signed_sin.shape
            and cos.shape[1:] == (head_dim,)
            and cos.is_contiguous()
            and signed_sin.is_contiguous()
            and positions.dtype == torch.int64
            and positions.shape == (rows,)
        )
        if not ok:
            raise ValueError(
                f"native rope: x {tuple(x.shape)} {x.dtype} ({heads} heads of {head_dim}), "
                f"tables {tuple(cos.shape)} {cos.dtype}, positions {tuple(positions.shape)}"
            )
        positions = positions.contiguous()
        if not positions_checked:
            check_positions(positions, cos.shape[0])
        self._rotate(
            x.data_ptr(), x.stride(0), rows, heads, head_dim, cos.data_ptr(),
            signed_sin.data_ptr(), positions.data_ptr(), int(x.dtype == torch.float32),
        )  # fmt: skip


def check_positions(positions: torch.Tensor, table_rows: int) -> None:
    """Each position a row of the tables (the kernel reads them unchecked)."""
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= table_rows):
        raise ValueError(f"native rope: positions outside the tables' {table_rows} rows")


@functools.cache
def native_rope() -> NativeRope | None:
    lib = native.load("rope_cpu.c")
    return None if lib is None else NativeRope(lib)
