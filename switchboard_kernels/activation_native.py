"""SwiGLU's ``silu(gate) * up`` in one native pass on CPU (``activation_cpu.c``), and
``silu_mul``, which takes it where it is built with a vector loop (AVX-512, or AVX2 with FMA)
and torch's two ops elsewhere.

Built and loaded by ``switchboard_kernels/native.py``; ``native_activation()`` is None where
it cannot be. Without a vector loop only the kernel's plain C loop would run, which torch's
vectorized ops outpace, so ``silu_mul`` keeps torch there.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from switchboard_kernels import native

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class NativeActivation:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._kernels = {
            torch.bfloat16: lib.sb_silu_mul_bf16,
            torch.float32: lib.sb_silu_mul_f32,
        }
        for fn in self._kernels.values():
            fn.restype = None
            fn.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _i64, ctypes.c_int]
        self.has_avx512 = bool(lib.sb_activation_has_avx512())
        # A vector loop (AVX-512, or AVX2 with FMA): only then does the kernel outpace torch.
        self.has_vector_loop = bool(lib.sb_activation_has_vector_loop())

    def address(self, dtype: torch.dtype) -> int:
        """The kernel for rows of ``dtype``, for native code that calls it."""
        return ctypes.cast(self._kernels[dtype], ctypes.c_void_p).value or 0

    def silu_mul(self, gate_up: torch.Tensor, *, portable: bool = False) -> torch.Tensor:
        """Semantics: ``F.silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``, bf16 or
        fp32 rows [rows, 2 * dim], rounded as torch rounds each of the two ops."""
        if (
            gate_up.dim() != 2
            or gate_up.dtype not in self._kernels
            or gate_up.stride(1) != 1
            or gate_up.shape[1] % 2
            or gate_up.device.type != "cpu"
        ):
            raise ValueError(
                f"native silu_mul: gate_up {tuple(gate_up.shape)} {gate_up.dtype}: bf16 or "
                "fp32 rows of even width on CPU"
            )
        rows, dim = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, dim, dtype=gate_up.dtype)
        self._kernels[gate_up.dtype](
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), dim, rows, dim, int(portable)
        )
        return out


@functools.cache
def native_activation() -> NativeActivation | None:
    """The kernel, built on first use; None where it cannot be (reason logged once)."""
    lib = native.load("activation_cpu.c")
    return None if lib is None else NativeActivation(lib)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over the two halves of ``gate_up``'s last dim: the native kernel
    for bf16 or fp32 rows where it has a vector loop, else torch's two ops."""
    if (
        gate_up.dim() == 2
        and gate_up.device.type == "cpu"
        and gate_up.dtype in (torch.bfloat16, torch.float32)
        and gate_up.stride(1) == 1
    ):
        kernel = native_activation()
        if kernel is not None and kernel.has_vector_loop:
            return kernel.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
