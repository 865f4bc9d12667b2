"""Dense projections with weights prepared once for the fastest matmul on this device.

On CPU, oneDNN re-packs a plain weight into its blocked layout on every call, which
halves the effective memory bandwidth of the small-batch matmuls that dominate decoding.
We pack each weight once at load time (the same op torch's inductor uses when it freezes a
CPU model) and call the packed matmul, faster at every batch size measured, most at the
small batches of decoding (bf16 and fp32: docs/performance.md). Results differ from
``F.linear`` only in summation order (~1e-7 relative in fp32).

On an AVX2-only CPU (where the engine runs in fp32) oneDNN's packed matmul is itself the
bottleneck of decoding: it streams weights at ~2/3 of what the cores can read and each row
added to a step costs more arithmetic time that does not hide behind the bytes. There the
weights go into panels for our own kernel (``switchboard_kernels/linear_cpu.c``), which reads them
once for every row of a step and prefetches the next panel while it computes.

A draft model for speculative decoding reads its weights from DRAM on every one-token
pass, so halving or quartering the bytes is what makes it cheaper; exactness does not
suffer, since the target verifies every draft (``quantization``). "int4": passes of up to
``Q4_MAX_ROWS`` rows multiply by 4-bit levels of the weight (per group of 64 input
features, an fp16 step and minimum) through our native kernel (``switchboard_kernels/q4_cpu.c``),
the activations rounded to int8 per group: faster than the bf16 packed matmul up to 16 rows,
over twice as fast at one (docs/performance.md). Without a C compiler, torch's CPU int4
kernel (the one torchao's int4 weight-only layout uses) serves up to ``INT4_MAX_ROWS``
rows: it widens each weight to float and ran at about half the native kernel's speed.
Larger batches use the full weight.
"int8" (fp32 CPUs): int8 panels with a scale per output feature, through the native panel
kernel.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from switchboard_kernels.linear_choice import ONEDNN, PANELS, UPCAST, LinearPlan, fixed_plan
from switchboard_kernels.linear_native import (
    Bf16PanelLinear,
    PanelLinear,
    native_linear,
    native_linear_bf16,
)
from switchboard_kernels.q4_native import GROUP as Q4_GROUP
from switchboard_kernels.q4_native import Q4Linear, native_q4, quantize_weight
from switchboard_kernels.quantized_linear import QuantizedReference
from switchboard_kernels.quantized_weight import QuantizedWeight
from switchboard_kernels.wq_native import WqLinear, fits, native_wq

if TYPE_CHECKING:
    from switchboard_kernels.wq_triton import TritonWq

# The packed layout is tuned for this many rows; larger batches still run correctly.
PACK_BATCH_HINT = 1024
# 4-bit weights: input features per scale/zero group, and the most rows that use them
# (measured crossover with the bf16 packed matmul: torch's kernel 5-6 rows, ours 16-32).
INT4_GROUP = 64
INT4_MAX_ROWS = 4
Q4_MAX_ROWS = 16
# A draft model's approximate weights (``Linear``'s ``quantization``): None for exact.
QUANTIZATIONS = (None, "int4", "int8")


def bf16_panels_preferred(weight: torch.Tensor) -> bool:
    """Whether ``Linear`` multiplies by this weight through the native bf16 kernel
    (``switchboard_kernels/linear_bf16_cpu.c``): bf16 on a CPU with AVX-512 or AVX2 and FMA,
    an even number of input features. On a 2-core Zen 4 (AVX512-BF16) it ran the default
    model's projections ~2x faster than oneDNN's packed matmul for 1-8 rows and still faster
    at 256; on a 2-core Xeon without AVX512-BF16, where oneDNN's bf16 matmul is emulated,
    1.5x at 1 row and 2.2-2.5x from 8 rows up; on an AVX2-only EPYC, where oneDNN packs
    no bf16 at all, 2.2x the fp32 panels at 1 row, 1.4x at 8, 0.8x at 256
    (``bench.linear``)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.shape[1] % 2 == 0
        and native_linear_bf16() is not None
    )


def can_quantize_int8(weight: torch.Tensor) -> bool:
    """Whether ``Linear(..., quantization="int8")`` can hold this weight: fp32 on CPU, where
    the native kernel (any CPU with a C compiler) multiplies fp32 rows by int8 panels."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and native_linear() is not None
    )


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``Linear`` keeps a oneDNN-packed copy of this weight (CPU, fp32/bf16/fp16)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and _packing_works(weight.dtype)
    )


def native_bf16() -> bool:
    """Whether this CPU's oneDNN computes bf16 matmuls natively. Without it (AVX2 only)
    its bf16 path is a slow fallback, several times slower than fp32 on a Zen 3
    (docs/performance.md), so ``dtype="auto"`` picks fp32 there."""
    return _packing_works(torch.bfloat16)


@functools.cache
def _packing_works(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs ``dtype`` weights: it refuses bf16 without AVX512-BW/VL/DQ
    or AVX-NE-CONVERT (e.g. on AVX2-only AMD Zen 3), so we try it once rather than guess
    from CPU flags."""
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def can_quantize_q4(weight: torch.Tensor) -> bool:
    """Whether ``Linear(..., quantization="int4")`` multiplies small batches through the
    native 4-bit kernel: CPU, fp32 or bf16, input features a multiple of its group."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and weight.shape[1] % Q4_GROUP == 0
        and native_q4() is not None
    )


def can_quantize_int4(weight: torch.Tensor) -> bool:
    """Whether torch's CPU int4 kernel can hold this weight (where the native one cannot):
    CPU, fp32 or bf16, input features a multiple of ``INT4_GROUP``."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and weight.shape[1] % INT4_GROUP == 0
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Int4Weight:
    """A weight [out, in] as 4-bit levels through torch's CPU kernel, the same levels as the
    native kernel's (``switchboard_kernels.q4_native.quantize_weight``: ``low + q * step`` per group
    of ``INT4_GROUP`` input features, q in 0..15), with the activations unrounded.
    ``fp32_out``: rows widened to fp32 first, the products fp32 out (an output layer)."""

    __slots__ = ("bias", "fp32_out", "packed", "scales_and_zeros")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, fp32_out: bool = False
    ) -> None:
        self.fp32_out = fp32_out
        q, step, low = quantize_weight(weight)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        step, low = step.float(), low.float()
        zero = low + 8 * step  # the kernel computes (q - 8) * scale + zero
        # [groups, out, 2] in the activations' dtype, as the kernel reads them
        both = torch.stack([step, zero], dim=-1).transpose(0, 1).contiguous()
        self.scales_and_zeros = both.to(torch.float32 if fp32_out else weight.dtype)
        self.bias = bias

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + _nbytes(self.scales_and_zeros)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.fp32_out:
            x = x.float()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, INT4_GROUP, self.scales_and_zeros
        )
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else residual + y


class OnednnLinear:
    """``x @ W.T (+ bias) (+ residual)`` through oneDNN's packed matmul, the weight reordered
    once into its blocked layout (the add fused into the matmul)."""

    __slots__ = ("bias", "nbytes", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        self.bias = bias
        self.nbytes = _nbytes(weight)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")


class TorchLinear:
    """``x @ W.T (+ bias) (+ residual)`` through ``F.linear`` on the plain weight (GPUs, and
    CPUs where neither oneDNN packs nor a native kernel builds). ``fp32_out``: the fp32 sums
    unrounded (``fp32_product``)."""

    __slots__ = ("bias", "fp32_out", "nbytes", "weight")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, fp32_out: bool = False
    ) -> None:
        self.weight, self.bias = weight, bias
        self.nbytes = _nbytes(weight)
        self.fp32_out = fp32_out and weight.dtype != torch.float32
        if self.fp32_out and weight.device.type == "cuda":
            _mm_out_dtype(weight.device.type, weight.dtype)  # probed at load, never in a capture

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.fp32_out:
            y = fp32_product(x, self.weight)
            y = y if self.bias is None else y + self.bias.float()
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if residual is None else residual + y


def fp32_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Semantics: ``x @ weight.T`` summed in fp32 and returned unrounded, [rows, out] fp32, for
    half-precision x [rows, in] and weight [out, in] (an output layer's logits, which rounded
    to bf16 tie often). On CUDA cuBLAS writes the fp32 sums (``out_dtype``); elsewhere the
    weight is widened a slice at a time (bf16 x bf16 products are exact in fp32)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.linear(x, weight)
    if x.device.type == "cuda" and _mm_out_dtype(x.device.type, x.dtype):
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    wide = x.float()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for start in range(0, weight.shape[0], _WIDEN_ROWS):
        part = weight[start : start + _WIDEN_ROWS]
        y[:, start : start + part.shape[0]] = F.linear(wide, part.float())
    return y


_WIDEN_ROWS = 1024  # weight rows widened at a time: ~2 MB of fp32 at hidden 576


@functools.cache
def _mm_out_dtype(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` runs for ``dtype`` on this device."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


class UpcastLinear:
    """bf16 ``x @ W.T (+ bias) (+ residual)`` through oneDNN's fp32 packed matmul, for CPUs
    whose oneDNN packs no bf16: the weight widened to fp32 once (exactly), each call's rows
    widened, the result rounded to bf16 once, as a bf16 kernel with fp32 sums rounds it
    (``fp32_out``: not rounded)."""

    __slots__ = ("fp32", "fp32_out", "nbytes")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, fp32_out: bool = False
    ) -> None:
        self.fp32 = OnednnLinear(weight.float(), None if bias is None else bias.float())
        self.nbytes = self.fp32.nbytes
        self.fp32_out = fp32_out

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        wide = None if residual is None else residual.float()
        y = self.fp32(x.float(), wide)
        return y if self.fp32_out else y.to(x.dtype)


Kernel = (
    PanelLinear
    | Bf16PanelLinear
    | OnednnLinear
    | UpcastLinear
    | TorchLinear
    | QuantizedReference
    | WqLinear
)


def quantized_kernel(
    q: QuantizedWeight, bias: torch.Tensor | None = None, *, fp32_out: bool = False
) -> Kernel | TritonWq:
    """A quantized base's projection: on CUDA the Triton dequantize-GEMM
    (``switchboard_kernels.wq_triton``); on CPU the native kernel streaming the packed levels
    where it builds and its layout holds the groups (``wq_native.fits``); else the torch
    reference (the weight dequantized once to fp32)."""
    if q.levels.device.type == "cuda" and (q.bits == 8 or q.shape[1] % 2 == 0):
        from switchboard_kernels.wq_triton import TritonWq as Triton  # triton: CUDA only

        return Triton(q, bias, fp32_out=fp32_out)
    if q.levels.device.type == "cpu" and native_wq() is not None and fits(q):
        return WqLinear(q, bias, fp32_out=fp32_out)
    return QuantizedReference(q, bias, fp32_out=fp32_out)


def make_kernel(
    name: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    fixed_order: bool = False,
    fp32_out: bool = False,
) -> Kernel:
    """The ``linear_choice`` kernel ``name`` over ``weight``, or the next one that can hold it
    (the bf16 panels need an even number of input features and a bf16 bias). ``fixed_order``:
    the panels' (``LinearPlan.fixed_order``); with it, no other kernel may stand in.
    ``fp32_out``: a kernel whose fp32 sums come out unrounded (``fp32_kernel``)."""
    if fp32_out and weight.dtype != torch.float32:
        return fp32_kernel(weight, bias, fixed_order=fixed_order)
    if name == PANELS:
        if bf16_panels_preferred(weight) and (bias is None or bias.dtype == torch.bfloat16):
            return Bf16PanelLinear(weight, bias, fixed_order=fixed_order)
        if weight.dtype == torch.float32 and weight.device.type == "cpu" and native_linear():
            return PanelLinear(weight, bias, fixed_order=fixed_order)
        if fixed_order:
            raise ValueError(
                f"batch-invariant products need the native panels for a {tuple(weight.shape)} "
                f"{weight.dtype} weight (an even number of input features, bf16 or fp32, CPU)"
            )
        name = ONEDNN
    if name == ONEDNN and can_pack(weight):
        return OnednnLinear(weight, bias)
    if name == UPCAST and weight.dtype == torch.bfloat16 and can_pack(weight.float()):
        return UpcastLinear(weight, bias)
    return TorchLinear(weight, bias)


def fp32_kernel(
    weight: torch.Tensor, bias: torch.Tensor | None = None, *, fixed_order: bool = False
) -> Kernel:
    """A half-precision weight's kernel with fp32 out, whatever the plan: the bf16 panels
    (the same bytes as bf16, their fp32 sums stored as they are), else oneDNN's fp32 matmul
    over the weight widened once (twice the bytes), else ``fp32_product``. oneDNN's bf16
    matmul writes bf16 only, so it never serves an output layer."""
    if bf16_panels_preferred(weight) and (bias is None or bias.dtype == torch.bfloat16):
        return Bf16PanelLinear(weight, bias, fixed_order=fixed_order, fp32_out=True)
    if fixed_order:
        raise ValueError(
            f"batch-invariant products need the native panels for a {tuple(weight.shape)} "
            f"{weight.dtype} weight (an even number of input features, bf16 or fp32, CPU)"
        )
    if weight.device.type == "cpu" and can_pack(weight.float()):
        return UpcastLinear(weight, bias, fp32_out=True)
    return TorchLinear(weight, bias, fp32_out=True)


class Linear:
    """``y = x @ weight.T + bias`` with ``weight`` [out_features, in_features].

    The weight is held once per kernel the ``plan`` names (``switchboard_kernels.linear_choice``:
    measured on this CPU, or its fixed rule), each in that kernel's layout: in panels for a
    native kernel (fp32 ``switchboard_kernels/linear_cpu.c``, bf16
    ``switchboard_kernels/linear_bf16_cpu.c``), reordered for oneDNN, or plain. Rows up to the
    plan's ``split_rows`` go to its small-row kernel, more to its large-row one.
    ``quantization`` (a draft model's; approximate): "int8", every product through int8 panels
    with a scale per output feature (fp32 weights, native kernel); "int4", small batches
    through a 4-bit copy (up to ``Q4_MAX_ROWS`` rows through the native kernel where
    ``can_quantize_q4``, else ``INT4_MAX_ROWS`` through torch's where ``can_quantize_int4``),
    others through the plan's kernels. ``fp32_out`` (an output layer): the products come out
    in fp32 with their sums unrounded, whatever the weight's dtype (logits rounded to bf16
    sit 0.125 apart near the top and tie often). A ``QuantizedWeight`` (a quantized base's, not a
    draft's: exact up to its weights' rounding) is multiplied by as it is, activations
    unrounded and sums in fp32 (``quantized_kernel``)."""

    __slots__ = ("bias", "fp32_out", "in_features", "int4", "int4_rows", "large")
    __slots__ += ("out_features", "small", "split_rows")

    def __init__(
        self,
        weight: torch.Tensor | QuantizedWeight,
        bias: torch.Tensor | None = None,
        *,
        quantization: str | None = None,
        plan: LinearPlan | None = None,
        fp32_out: bool = False,
    ) -> None:
        if isinstance(weight, QuantizedWeight):
            if quantization is not None:
                raise ValueError("a quantized weight takes no draft quantization")
            self.out_features, self.in_features = weight.shape
            self.bias, self.fp32_out = bias, fp32_out
            self.int4, self.int4_rows = None, 0
            self.small = self.large = quantized_kernel(weight, bias, fp32_out=fp32_out)
            self.split_rows = 0
            return
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.fp32_out = fp32_out
        self.int4: Q4Linear | Int4Weight | None = None
        self.int4_rows = 0  # the most rows that go through ``int4``
        if quantization == "int4" and can_quantize_q4(weight):
            self.int4, self.int4_rows = Q4Linear(weight, bias), Q4_MAX_ROWS
        elif quantization == "int4" and can_quantize_int4(weight):
            self.int4 = Int4Weight(weight, bias, fp32_out=fp32_out)
            self.int4_rows = INT4_MAX_ROWS
        if quantization == "int8":
            if not can_quantize_int8(weight):
                raise ValueError("int8 weights need fp32 on CPU and the native linear kernel")
            plan, kernel = LinearPlan(PANELS, PANELS), PanelLinear(weight, bias, int8=True)
            self.small = self.large = kernel
        else:
            plan = plan or fixed_plan(weight.dtype, weight.device)
            order = plan.fixed_order
            self.small = make_kernel(plan.small, weight, bias, fixed_order=order, fp32_out=fp32_out)
            self.large = (
                self.small
                if plan.large == plan.small or (fp32_out and weight.dtype != torch.float32)
                else make_kernel(plan.large, weight, bias, fixed_order=order)
            )
        self.split_rows = plan.split_rows

    @property
    def decode_bytes(self) -> int:
        """Bytes a one-row product reads: the 4-bit copy's where there is one."""
        if self.int4 is not None:
            return self.int4.nbytes
        return self.small.nbytes

    @property
    def kernels(self) -> tuple[Kernel, ...]:
        return (self.small,) if self.large is self.small else (self.small, self.large)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self.int4_rows and self.int4 is not None:
            # the native 4-bit kernel's output takes the rows' dtype
            return self.int4(x.float() if self.fp32_out else x)
        return (self.small if rows <= self.split_rows else self.large)(x)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T (+ bias)``; on CPU the add is fused into the matmul. An fp32
        ``residual`` beside half-precision rows (a bf16 model's residual stream) stays fp32:
        the bf16 panels and the quantized-weight kernel add it to their fp32 sums, other
        kernels' rounded product is added."""
        rows = x.shape[0]
        if residual.dtype != x.dtype:
            kernel = self.small if rows <= self.split_rows else self.large
            if isinstance(kernel, Bf16PanelLinear) and not kernel.fp32_out:
                return kernel.add_to_fp32(x, residual)
            if isinstance(kernel, WqLinear):
                return kernel(x, residual, fp32_sum=True)
            return residual.add_(self(x))
        if rows <= self.int4_rows and self.int4 is not None:
            return self.int4(x, residual)
        return (self.small if rows <= self.split_rows else self.large)(x, residual)
