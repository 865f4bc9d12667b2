"""The native kernel for a quantized base's projections (``switchboard_kernels/wq_cpu.c``): 4- or
8-bit levels streamed from memory and widened in registers, times fp32 (or bf16) rows, never
rounded, with fp32 sums.

Built and loaded by ``switchboard_kernels/native.py``; ``native_wq()`` is None where it cannot be,
and ``switchboard_kernels.linear.Linear`` then keeps the torch reference
(``switchboard_kernels.quantized_linear.QuantizedReference``).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from switchboard_kernels import native
from switchboard_kernels.huge_pages import copy_to_huge_pages
from switchboard_kernels.panel_levels import by_panel, pack_levels
from switchboard_kernels.quantized_weight import QuantizedWeight

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class WqPath:
    """Which loops of wq_cpu.c a call runs (its ``path`` argument)."""

    BEST = 0
    AVX2 = 1
    PORTABLE = 2


class _Wq(ctypes.Structure):
    """``struct sb_wq`` in wq_cpu.c."""

    _fields_ = [
        ("in_features", _i64),
        ("out_features", _i64),
        ("group_size", _i64),
        ("bits", _i64),
        ("blocks", _ptr),
        ("bias", _ptr),
        ("half_params", _i64),
    ]


def fits(q: QuantizedWeight) -> bool:
    """Whether the kernel's layout holds ``q``: whole 64-byte steps of levels per group
    (groups of a multiple of 8 features at 4 bits, of 4 at 8 bits)."""
    return q.group_size % (8 if q.bits == 4 else 4) == 0


def fp16_exact(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is an fp16 value (so the kernel may hold it in 2 bytes)."""
    return bool(torch.equal(t.half().float(), t.float()))


def pack(q: QuantizedWeight) -> tuple[torch.Tensor, bool]:
    """``q`` in the kernel's layout: [panels, groups, levels + 16 scales + 16 zeros] bytes, and
    whether the scales and zeros are stored fp16 (where every one of them is an fp16 value,
    as a GPTQ or AWQ checkpoint's and the on-load quantizer's are), else fp32."""
    levels = pack_levels(q.levels, q.bits, q.group_size)
    panels, groups = levels.shape[:2]
    half = fp16_exact(q.scales) and fp16_exact(q.zeros)
    dtype = torch.float16 if half else torch.float32

    def params(t: torch.Tensor) -> torch.Tensor:  # [out, groups] -> [p, g, 16 values] bytes
        return by_panel(t.float()).to(dtype).view(torch.uint8).view(panels, groups, -1)

    return torch.cat([levels, params(q.scales), params(q.zeros)], dim=-1).contiguous(), half


class WqLinear:
    """``y = x @ q.dequantize().T (+ bias) (+ residual)`` through the native kernel: bf16 or
    fp32 rows in (act-order weights' columns permuted once a call), the rows' dtype out, or
    fp32 with ``fp32_out``. The kernel must load (``native_wq()``) and hold ``q`` (``fits``)."""

    __slots__ = ("_call", "_desc", "bias", "blocks", "desc_address", "fp32_out", "in_features")
    __slots__ += ("input_order", "nbytes", "out_features")

    def __init__(
        self,
        q: QuantizedWeight,
        bias: torch.Tensor | None = None,
        *,
        fp32_out: bool = False,
        kernel: NativeWq | None = None,  # another build of wq_cpu.c (a bench's --against)
    ) -> None:
        kernel = kernel or native_wq()
        if kernel is None:
            raise RuntimeError("the native quantized-weight kernel is not available here")
        if not fits(q):
            raise ValueError(f"{q.bits}-bit groups of {q.group_size} do not fit the kernel")
        self.out_features, self.in_features = q.shape
        blocks, half_params = pack(q)
        self.blocks = copy_to_huge_pages(blocks)
        self.nbytes = blocks.numel()
        self.input_order = q.input_order
        self.fp32_out = fp32_out
        self.bias = None if bias is None else bias.float().contiguous()
        self._desc = _Wq(
            self.in_features,
            self.out_features,
            q.group_size,
            q.bits,
            self.blocks.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
            half_params,
        )
        self.desc_address = ctypes.addressof(self._desc)
        self._call = kernel.linear

    def __call__(
        self,
        x: torch.Tensor,  # [rows, in] bf16 or fp32
        residual: torch.Tensor | None = None,  # [rows, out], the output's dtype
        *,
        path: int = WqPath.BEST,
        fp32_sum: bool = False,
    ) -> torch.Tensor:  # [rows, out]: x's dtype, or fp32 with fp32_out or fp32_sum
        """Semantics: ``x @ W.T (+ bias) (+ residual)`` summed in fp32, rounded once to the
        output's dtype; W the dequantized weight. ``fp32_sum``: this call's sum comes out
        fp32, unrounded (added to a bf16 model's fp32 residual stream)."""
        out = torch.float32 if self.fp32_out or fp32_sum else x.dtype
        if residual is not None and residual.dtype != out:
            residual = residual.to(out)
        if self.input_order is not None:
            x = x.index_select(1, self.input_order)  # column j multiplies feature order[j]
        x, res = native.checked_rows(
            "native quantized linear",
            x,
            None,
            in_features=self.in_features,
            out_features=self.out_features,
            dtypes=(torch.bfloat16, torch.float32),
        )
        rows = x.shape[0]
        if residual is not None:
            if residual.shape != (rows, self.out_features):
                raise ValueError(
                    f"native quantized linear: residual must be ({rows}, {self.out_features})"
                )
            res = residual.contiguous()
        y = torch.empty(rows, self.out_features, dtype=out)
        fp32_in = x.dtype == torch.float32
        res_address = None if res is None else res.data_ptr()
        if rows and self._call(
            self.desc_address,
            x.data_ptr(),
            fp32_in,
            rows,
            res_address,
            y.data_ptr(),
            out == torch.float32,
            path,
        ):
            raise MemoryError("native quantized linear: no memory for the widened rows")
        return y


class NativeWq:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.linear = lib.sb_wq_linear
        self.linear.restype = _int
        self.linear.argtypes = [_ptr, _ptr, _int, _i64, _ptr, _ptr, _int, _int]
        paths = lib.sb_wq_paths
        paths.restype = _int
        mask = paths()
        # The loops this build has, best first (WqPath values).
        self.paths = [p for p, bit in ((0, 1), (1, 2), (2, 4)) if mask & bit]
        self.bf16 = bool(mask & 8)  # path 0 runs bf16 rows by 4-bit levels as bf16 pairs


@functools.cache
def native_wq() -> NativeWq | None:
    """The kernel, built on first use; None where it cannot be (reason logged once)."""
    lib = native.load("wq_cpu.c")
    return None if lib is None else NativeWq(lib)
