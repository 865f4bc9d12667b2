"""Dense projections with weights prepared once for the fastest matmul on this device.

On CPU, oneDNN re-packs a plain weight into its blocked layout on every call, which
halves the effective memory bandwidth of the small-batch matmuls that dominate decoding.
We pack each weight once at load time (the same op torch's inductor uses when it freezes a
CPU model) and call the packed matmul; measured on a 576x3072 bf16 weight streamed from
DRAM (AVX512-BF16): 163 us vs 266 us at 1 token, 1.8 ms vs 2.5 ms at 1,024 tokens; fp32 on
an AVX2-only AMD Zen 3 (576x1536, against ``F.linear``'s MKL path): 288 vs 414 us at 1
token, 0.58 vs 1.0 ms at 32, 14 vs 17 ms at 1,024. Results differ from ``F.linear`` only
in summation order (~1e-7 relative in fp32).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# The packed layout is tuned for this many rows; larger batches still run correctly.
PACK_BATCH_HINT = 1024


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``Linear`` keeps a oneDNN-packed copy of this weight (CPU, fp32/bf16/fp16)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and _packing_works(weight.dtype)
    )


def native_bf16() -> bool:
    """Whether this CPU's oneDNN computes bf16 matmuls natively. Without it (AVX2 only)
    its bf16 path is a slow fallback: 14.6 GFLOPS against fp32's 80-140 on a Zen 3 here,
    so ``dtype="auto"`` picks fp32 there."""
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


class Linear:
    """``y = x @ weight.T + bias`` with ``weight`` [out_features, in_features]."""

    __slots__ = ("bias", "in_features", "out_features", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight
        if can_pack(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            self.weight = None  # the packed copy replaces it; keep one copy in memory

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T (+ bias)``; on CPU the add is fused into the matmul."""
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(
                x, residual, self.packed, self.bias, "add"
            )
        return residual + F.linear(x, self.weight, self.bias)
