"""The native CPU projection kernel (``linear_cpu.c``): weights packed in panels.

Built and loaded by ``switchboard_kernels/native.py``; ``native_linear()`` is None where it cannot
be, and ``switchboard_kernels.linear.Linear`` then uses oneDNN's packed matmul (or ``F.linear``).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from switchboard_kernels import native
from switchboard_kernels.huge_pages import copy_to_huge_pages

PANEL = 16  # output features per panel, as NR in linear_cpu.c
INT8_LEVELS = 127  # symmetric int8: q in [-127, 127], W[n] ~ q[n] * scale[n]
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Panels(ctypes.Structure):
    """``struct sb_panels`` in linear_cpu.c."""

    _fields_ = [
        ("in_features", _i64),
        ("out_features", _i64),
        ("panels", _ptr),
        ("scales", _ptr),
        ("bias", _ptr),
        ("fixed_order", _i64),
    ]


class PanelLinear:
    """``y = x @ weight.T (+ bias)`` through the native kernel, the weight [out, in] in panels
    of ``PANEL`` output features, each [in][PANEL] (one cache line of fp32 weights per input
    feature), the last one zero-padded: fp32, or int8 with one scale per output feature (an
    approximate copy). The kernel must load (``native_linear()``). ``fixed_order``: a lone row
    sums in the order every row of a larger call does (batch-invariant numerics), not in the
    two chains that make one-row products faster."""

    __slots__ = ("_call", "_desc", "_desc_address", "bias", "in_features", "out_features")
    __slots__ += ("panels", "scales")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        int8: bool = False,
        fixed_order: bool = False,
        kernel: NativeLinear | None = None,
    ) -> None:
        """``kernel``: another build's (a bench times one version of the source beside ours)."""
        kernel = kernel or native_linear()
        if kernel is None:
            raise RuntimeError("the native linear kernel is not available here")
        out_features, in_features = weight.shape
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,)):
            raise ValueError(f"native linear: bias must be fp32 ({out_features},)")
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else bias.contiguous()
        padded = -(-out_features // PANEL) * PANEL
        w = torch.zeros(padded, in_features, dtype=torch.float32)
        w[:out_features] = weight.float()
        self.scales: torch.Tensor | None = None
        if int8:
            # [padded]: the largest magnitude of each output's weights maps to 127
            scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)
            scales /= INT8_LEVELS
            w = torch.round(w / scales[:, None]).clamp(-INT8_LEVELS, INT8_LEVELS)
            w = w.to(torch.int8)
            self.scales = scales.contiguous()
        # [padded, in] -> [panels, in, PANEL]
        self.panels = copy_to_huge_pages(
            w.view(padded // PANEL, PANEL, in_features).transpose(1, 2)
        )
        self._desc = _Panels(
            in_features,
            out_features,
            self.panels.data_ptr(),
            None if self.scales is None else self.scales.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
            int(fixed_order),
        )
        self._desc_address = ctypes.addressof(self._desc)
        self._call = kernel.linear

    @property
    def nbytes(self) -> int:
        """The weight's bytes as held (the last panel's padding not counted)."""
        count = self.out_features * self.in_features
        if self.scales is None:
            return count * 4
        return count + self.out_features * 4

    def dequantized(self) -> torch.Tensor:
        """The weight this copy multiplies by, [out, in] fp32 (exact for fp32 panels)."""
        w = self.panels.transpose(1, 2).reshape(-1, self.in_features).float()
        if self.scales is not None:
            w = w * self.scales[:, None]
        return w[: self.out_features]

    def __call__(
        self,
        x: torch.Tensor,  # [rows, in] fp32
        residual: torch.Tensor | None = None,  # [rows, out] fp32
    ) -> torch.Tensor:  # [rows, out] fp32
        """Semantics: ``x @ W.T (+ bias) (+ residual)``, W the weight the panels hold."""
        return _run_panels(self, "native linear", torch.float32, x, residual)


def _run_panels(
    linear: PanelLinear | Bf16PanelLinear,
    label: str,
    dtype: torch.dtype,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    *,
    out: torch.dtype | None = None,
) -> torch.Tensor:
    """One call of a panel kernel over checked rows: ``x @ W.T (+ bias) (+ residual)``, in
    ``out`` (default ``dtype``, the rows')."""
    x, res = native.checked_rows(
        label,
        x,
        residual,
        in_features=linear.in_features,
        out_features=linear.out_features,
        dtypes=(dtype,),
    )
    rows = x.shape[0]
    y = torch.empty(rows, linear.out_features, dtype=out or dtype)

    if rows:  # res (a copy checked_rows may have made) lives until the call returns
        res_address = None if res is None else res.data_ptr()
        linear._call(linear._desc_address, x.data_ptr(), rows, res_address, y.data_ptr())
    return y


class NativeLinear:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.linear = lib.sb_linear
        self.linear.restype = None
        self.linear.argtypes = [_ptr, _ptr, _i64, _ptr, _ptr]


@functools.cache
def native_linear() -> NativeLinear | None:
    """The kernel, built on first use; None where it cannot be (reason logged once)."""
    lib = native.load("linear_cpu.c")
    return None if lib is None else NativeLinear(lib)


BF16_PANEL = 32  # output features per bf16 panel, as NP in linear_bf16_cpu.c
# Calls of this many rows or more take AMX tiles where built (amx_bf16.h). On a 2-core AMX Xeon
# a step's projections took 9.5 ms on the vector tiles against 11.0 on AMX at 1 row, 12.8
# against 10.7 at 2 (bench/README.md); which of the panels and oneDNN serves each row count is
# still measured per CPU (``linear_choice``).
AMX_MIN_ROWS = 2


class _Bf16Panels(ctypes.Structure):
    """``struct sb_bf16_panels`` in linear_bf16_cpu.c."""

    _fields_ = [
        ("in_features", _i64),
        ("out_features", _i64),
        ("panels", _ptr),
        ("bias", _ptr),
        ("fixed_order", _i64),
        ("f32_out", _i64),
        ("amx_rows", _i64),
    ]


class Bf16PanelLinear:
    """``y = x @ weight.T (+ bias)`` in bf16 through the native kernel: the weight
    [out, in] (in even) in panels of ``BF16_PANEL`` outputs whose weights pair up along the
    input features (the layout VDPBF16PS reads), the last panel zero-padded. fp32 sums,
    one rounding to bf16 (bias and residual added before it). The kernel must load
    (``native_linear_bf16()``). ``fixed_order``: as ``PanelLinear``'s. ``fp32_out``: the
    sums come out as fp32, never rounded (an output layer's logits)."""

    __slots__ = ("_call", "_desc", "_desc_address", "bias", "fp32_out", "in_features")
    __slots__ += ("out_features", "panels", "_fp32_sum", "_fp32_sum_address")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        kernel=None,
        fixed_order: bool = False,
        fp32_out: bool = False,
        amx_rows: int | None = None,
    ) -> None:
        """``kernel``: another build's ``bf16_kernel_of`` (tests run the path a CPU lacks).
        ``amx_rows``: calls of at least this many rows multiply on AMX tiles where the build
        has them (0: never; default ``AMX_MIN_ROWS``)."""
        kernel = kernel or native_linear_bf16()
        if kernel is None:
            raise RuntimeError("the native bf16 linear kernel is not available here")
        out_features, in_features = weight.shape
        if weight.dtype != torch.bfloat16 or in_features % 2:
            raise ValueError("native bf16 linear: a bf16 weight with an even in_features")
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (out_features,)):
            raise ValueError(f"native bf16 linear: bias must be bf16 ({out_features},)")
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else bias.contiguous()
        self.fp32_out = fp32_out
        padded = -(-out_features // BF16_PANEL) * BF16_PANEL
        w = torch.zeros(padded, in_features, dtype=torch.bfloat16)
        w[:out_features] = weight
        # [panels, 2 halves, 16 outputs, pairs, 2] -> [panels, pairs, 2 halves, 16 outputs, 2]
        w = w.view(padded // BF16_PANEL, 2, 16, in_features // 2, 2)
        self.panels = copy_to_huge_pages(w.permute(0, 3, 1, 2, 4))
        self._desc = _Bf16Panels(
            in_features,
            out_features,
            self.panels.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
            int(fixed_order),
            int(fp32_out),
            amx_rows if amx_rows is not None else AMX_MIN_ROWS,
        )
        self._desc_address = ctypes.addressof(self._desc)
        # The same panels with fp32 out: an fp32 residual read and the sum stored unrounded.
        self._fp32_sum = _Bf16Panels(*(getattr(self._desc, f) for f, _ in _Bf16Panels._fields_))
        self._fp32_sum.f32_out = 1
        self._fp32_sum_address = ctypes.addressof(self._fp32_sum)
        self._call = kernel

    @property
    def nbytes(self) -> int:
        """The weight's bytes as held (the last panel's padding not counted)."""
        return self.out_features * self.in_features * 2

    def weight(self) -> torch.Tensor:
        """The weight the panels hold, [out, in] bf16."""
        w = self.panels.permute(0, 2, 3, 1, 4).reshape(-1, self.in_features)
        return w[: self.out_features]

    def __call__(
        self,
        x: torch.Tensor,  # [rows, in] bf16
        residual: torch.Tensor | None = None,  # [rows, out] bf16
    ) -> torch.Tensor:  # [rows, out] bf16 (fp32 with fp32_out)
        """Semantics: ``bf16(x @ W.T + bias + residual)``, summed in fp32 (``fp32_out``: the
        fp32 sum itself, unrounded)."""
        if self.fp32_out and residual is not None:  # the kernel reads an fp32 residual then
            return self.add_to_fp32(x, residual.float())
        out = torch.float32 if self.fp32_out else torch.bfloat16
        return _run_panels(self, "native bf16 linear", torch.bfloat16, x, residual, out=out)

    def add_to_fp32(
        self,
        x: torch.Tensor,  # [rows, in] bf16
        residual: torch.Tensor,  # [rows, out] fp32
    ) -> torch.Tensor:  # [rows, out] fp32
        """Semantics: ``x @ W.T + bias + residual`` summed in fp32 and returned unrounded (a
        bf16 model's fp32 residual stream: ``worker/model/llama.py``)."""
        x, _ = native.checked_rows(
            "native bf16 linear",
            x,
            None,
            in_features=self.in_features,
            out_features=self.out_features,
            dtypes=(torch.bfloat16,),
        )
        rows = x.shape[0]
        if residual.dtype != torch.float32 or residual.shape != (rows, self.out_features):
            raise ValueError(
                f"native bf16 linear: an fp32 residual ({rows}, {self.out_features}), not "
                f"{residual.dtype} {tuple(residual.shape)}"
            )
        residual = residual.contiguous()
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        if rows:
            self._call(
                self._fp32_sum_address, x.data_ptr(), rows, residual.data_ptr(), y.data_ptr()
            )
        return y


@functools.cache
def native_linear_bf16():
    """The bf16 kernel, built on first use; None where it cannot be (no compiler, or a CPU
    with neither AVX-512 nor AVX2 and FMA)."""
    lib = native.load("linear_bf16_cpu.c")
    if lib is None or not lib.sb_linear_bf16_available():
        return None
    return bf16_kernel_of(lib)


@functools.cache
def bf16_panels_use_amx() -> bool:
    """Whether the bf16 panels multiply calls of ``AMX_MIN_ROWS`` rows or more on AMX tiles
    here (built for them, and the OS lends them to the process)."""
    lib = native.load("linear_bf16_cpu.c")
    return bool(lib is not None and lib.sb_linear_bf16_available() and lib.sb_linear_bf16_amx())


def bf16_kernel_of(lib: ctypes.CDLL):
    """``sb_linear_bf16`` of a build of linear_bf16_cpu.c, typed for ctypes."""
    kernel = lib.sb_linear_bf16
    kernel.restype = None
    kernel.argtypes = [_ptr, _ptr, _i64, _ptr, _ptr]
    return kernel
