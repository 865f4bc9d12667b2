"""Projections over a weight-only quantized weight (``switchboard_kernels.quantized_weight``).

``QuantizedReference`` is the torch reference every quantized kernel is tested against, and the
path wherever no kernel holds the weight: the weight dequantized once to fp32, each call's rows
widened, the fp32 product rounded once to the rows' dtype (``fp32_out``: not rounded). The
activations are never quantized: as PEFT and transformers compute over a quantized layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from switchboard_kernels.quantized_weight import QuantizedWeight


class QuantizedReference:
    """Semantics: ``y = x @ dequantize(q).T (+ bias) (+ residual)``, summed in fp32."""

    __slots__ = ("bias", "fp32_out", "nbytes", "weight")

    def __init__(
        self, q: QuantizedWeight, bias: torch.Tensor | None = None, *, fp32_out: bool = False
    ) -> None:
        self.weight = q.dequantize(torch.float32)  # [out, in]
        self.bias = None if bias is None else bias.float()
        self.fp32_out = fp32_out
        self.nbytes = q.packed_bytes  # what a kernel streaming the packed levels reads

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = F.linear(x.float(), self.weight, self.bias)  # [rows, out] fp32
        if residual is not None:
            y = y + residual.float()
        return y if self.fp32_out else y.to(x.dtype)
