"""The native 4-bit projection kernel (``switchboard_kernels/q4_cpu.c``): a draft model's weights as
4-bit levels, multiplied by its activations rounded to int8.

Built and loaded by ``switchboard_kernels/native.py``; ``native_q4()`` is None where it cannot be,
and ``switchboard_kernels.linear.Linear`` then keeps torch's int4 kernel for a draft's small passes.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from switchboard_kernels import native
from switchboard_kernels.panel_levels import PANEL, by_panel, pack_levels

GROUP = 64  # input features per step and low (Q4_GROUP)
LEVELS = 15  # q in 0..15
ACTIVATION_LEVELS = 127  # activations: xq in -127..127 per row and group
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class Q4Path:
    """Which loops of q4_cpu.c a call runs (its ``path`` argument)."""

    BEST = 0
    AVX2 = 1
    PORTABLE = 2


class _Q4(ctypes.Structure):
    """``struct sb_q4`` in q4_cpu.c."""

    _fields_ = [("in_features", _i64), ("out_features", _i64), ("blocks", _ptr), ("bias", _ptr)]


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] -> (q [out, in] uint8 in 0..15, step and low [out, in / GROUP] fp16): per
    group, 16 levels from its minimum (rounded to fp16) by fp16 steps, each weight rounded
    to the nearest level, so ``low + q * step`` is the weight the kernel multiplies by."""
    out_features, in_features = weight.shape
    w = weight.float().view(out_features, in_features // GROUP, GROUP)
    low = w.amin(-1).half()
    step = ((w.amax(-1) - low.float()) / LEVELS).half()
    if not (torch.isfinite(low).all() and torch.isfinite(step).all()):
        raise ValueError("4-bit weights: values beyond fp16's range")
    steps = step.float()[..., None]
    levels = torch.where(steps > 0, (w - low.float()[..., None]) / steps, 0.0)
    q = torch.round(levels).clamp(0, LEVELS).to(torch.uint8).view(out_features, in_features)
    return q, step, low


def dequantize_weight(q: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [out, in] that ``quantize_weight``'s levels stand for."""
    out_features = q.shape[0]
    levels = q.float().view(out_features, -1, GROUP)
    return (low.float()[..., None] + levels * step.float()[..., None]).view(out_features, -1)


def _blocks(q: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The kernel's layout (q4_cpu.c): [panels, groups, 576] bytes, outputs zero-padded to
    whole panels; in each block the group's levels in the shared lane layout
    (``panel_levels.pack_levels``: 8 steps of [16 lanes][4 bytes]), then 16 steps, 16 lows."""
    nibbles = pack_levels(q, 4, GROUP)
    panels, groups = nibbles.shape[:2]

    def by_block(t: torch.Tensor) -> torch.Tensor:  # [out, groups] fp16 -> [p, g, 32] bytes
        return by_panel(t).view(torch.uint8).view(panels, groups, 2 * PANEL)

    return torch.cat([nibbles, by_block(step), by_block(low)], dim=-1).contiguous()


class Q4Linear:
    """``y = x @ W.T (+ bias)`` with W as 4-bit levels (``quantize_weight``) and x rounded
    to int8 per row and group of ``GROUP`` features: approximate, for a draft model. bf16 or
    fp32 rows in, the same dtype out. The kernel must load (``native_q4()``)."""

    __slots__ = ("_call", "_desc", "bias", "blocks", "desc_address", "in_features")
    __slots__ += ("out_features",)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        kernel = native_q4()
        if kernel is None:
            raise RuntimeError("the native 4-bit kernel is not available here")
        out_features, in_features = weight.shape
        if in_features % GROUP:
            raise ValueError(f"4-bit weights need input features in multiples of {GROUP}")
        self.out_features, self.in_features = out_features, in_features
        self.blocks = _blocks(*quantize_weight(weight))
        self.bias = None if bias is None else bias.float().contiguous()
        self._desc = _Q4(
            in_features,
            out_features,
            self.blocks.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
        )
        self.desc_address = ctypes.addressof(self._desc)  # what a kernel call passes
        self._call = kernel.linear

    @property
    def nbytes(self) -> int:
        """What a one-row product reads: the blocks (a half byte a weight, steps and lows)."""
        return self.blocks.numel()

    def __call__(
        self,
        x: torch.Tensor,  # [rows, in] bf16 or fp32
        residual: torch.Tensor | None = None,  # [rows, out], x's dtype
        *,
        path: int = Q4Path.BEST,
    ) -> torch.Tensor:  # [rows, out], x's dtype
        """Semantics: ``xq @ W.T (+ bias) (+ residual)`` in fp32, rounded once to x's dtype,
        xq the rows as their int8 levels."""
        x, res = native.checked_rows(
            "native 4-bit linear",
            x,
            residual,
            in_features=self.in_features,
            out_features=self.out_features,
            dtypes=(torch.bfloat16, torch.float32),
        )
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features, dtype=x.dtype)
        fp32 = x.dtype == torch.float32
        res_address = None if res is None else res.data_ptr()
        if rows and self._call(
            self.desc_address, x.data_ptr(), fp32, rows, res_address, y.data_ptr(), path
        ):
            raise MemoryError("native 4-bit linear: no memory for the rounded rows")
        return y


class NativeQ4:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.linear = lib.sb_q4_linear
        self.linear.restype = _int
        self.linear.argtypes = [_ptr, _ptr, _int, _i64, _ptr, _ptr, _int]
        paths = lib.sb_q4_paths
        paths.restype = _int
        mask = paths()
        # The loops this build has, best first (Q4Path values).
        self.paths = [p for p, bit in ((0, 1), (1, 2), (2, 4)) if mask & bit]


@functools.cache
def native_q4() -> NativeQ4 | None:
    """The kernel, built on first use; None where it cannot be (reason logged once)."""
    lib = native.load("q4_cpu.c")
    return None if lib is None else NativeQ4(lib)
