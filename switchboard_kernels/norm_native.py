"""The native CPU RMSNorm for bf16 or fp32 rows (``norm_cpu.c``), and ``rms_norm``; fp32 rows
with a bf16 weight (a bf16 model's fp32 residual stream) come out bf16.

Built and loaded by ``switchboard_kernels/native.py``; ``native_norm()`` is None where it cannot be,
and ``rms_norm`` then uses torch's op.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from switchboard_kernels import native

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
NATIVE_DTYPES = (torch.bfloat16, torch.float32)


class NativeNorm:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norms = {
            (torch.bfloat16, torch.bfloat16): lib.sb_rms_norm_bf16,
            (torch.float32, torch.float32): lib.sb_rms_norm_f32,
            (torch.float32, torch.bfloat16): lib.sb_rms_norm_f32_bf16,
        }
        for fn in self._norms.values():
            fn.restype = None
            fn.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_float]

    def address(self, x_dtype: torch.dtype, weight_dtype: torch.dtype) -> int:
        """The kernel for such rows and weight, for native code that calls it."""
        return ctypes.cast(self._norms[(x_dtype, weight_dtype)], ctypes.c_void_p).value or 0

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Semantics: ``F.rms_norm(x, weight.shape, weight, eps)`` for bf16 or fp32 ``x``
        [rows, dim] (fp32 inside, one rounding), in the weight's dtype."""
        kernel = self._norms.get((x.dtype, weight.dtype))
        if (
            x.dim() != 2
            or kernel is None
            or x.stride(1) != 1
            or not weight.is_contiguous()
            or weight.shape != (x.shape[1],)
        ):
            raise ValueError(
                f"native rms_norm: x {tuple(x.shape)} {x.dtype}, "
                f"weight {tuple(weight.shape)} {weight.dtype}: bf16 or fp32 rows, "
                "a matching or bf16 weight"
            )
        out = torch.empty(x.shape, dtype=weight.dtype)
        args = (x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0))
        kernel(*args, x.shape[0], x.shape[1], eps)
        return out


@functools.cache
def native_norm() -> NativeNorm | None:
    """The kernel, built on first use; None where it cannot be (reason logged once)."""
    lib = native.load("norm_cpu.c")
    return None if lib is None else NativeNorm(lib)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: the native kernel for bf16 or fp32 rows on CPU, else
    torch's op (in bf16 both round once where HF rounds twice)."""
    if x.dtype in NATIVE_DTYPES and x.dim() == 2 and not x.is_cuda:
        kernel = native_norm()
        if kernel is not None:
            return kernel(x, weight, eps)
    return torch_rms_norm(x, weight, eps)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's RMSNorm, in the weight's dtype: fp32 rows of a half-precision model (its fp32
    residual stream) are normalized in fp32 and rounded once."""
    if x.dtype == weight.dtype:
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(weight.dtype)
