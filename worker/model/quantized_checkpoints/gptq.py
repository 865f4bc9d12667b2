"""GPTQ checkpoints (Frantar et al., ICLR 2023) as AutoGPTQ, GPTQModel and transformers save them.

Per quantized projection [out, in] with ``per = 32 // bits`` levels a word:
``qweight`` int32 [in / per, out] (input features packed), ``qzeros`` int32 [groups, out / per]
(output features packed), ``scales`` fp16 [groups, out], ``g_idx`` int32 [in] (each input
feature's group: act-order when not in order). ``w[o, i] = (q[i, o] - z[g_idx[i], o]) *
scales[g_idx[i], o]``, where the zero is stored minus one in ``checkpoint_format`` "gptq" (v1, the
AutoGPTQ convention) and as it is in "gptq_v2". Served: 4 and 8 bits, any group size (-1: one per
output feature), act-order, symmetric or not. Refused by name: other bit widths (2 and 3 bits pack
differently), other packings (Marlin, BitBLAS, ...), per-module overrides (GPTQModel's ``dynamic``),
a quantized lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from switchboard_kernels.quantized_weight import QuantizedWeight
from worker.errors import ModelLoadError
from worker.model.quantized_checkpoints.act_order import grouped_weight
from worker.model.quantized_checkpoints.packing import (
    FLOATS,
    expect,
    scales_fp32,
    tensor,
    unpack_int32,
)

FORMATS = ("gptq", "gptq_v2")
# One in every field of a word: v1 stores each zero minus one, as a word minus this (a zero of 0
# borrows from the next field), so v2's word is v1's plus it, modulo 2**32 (GPTQModel's reading).
ONES = {4: 0x11111111, 8: 0x01010101}


@dataclass(frozen=True, slots=True)
class GptqReader:
    method: ClassVar[str] = "gptq"
    tensor_names: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales", "g_idx")

    bits: int
    group_size: int  # -1: one group per output feature
    v2: bool  # zeros stored as they are (gptq_v2), else minus one (gptq)

    @classmethod
    def from_config(cls, config: dict) -> GptqReader:
        """The reader for ``quantization_config``, or a refusal naming the option not served."""
        bits = config.get("bits")
        if bits not in (4, 8):
            raise ModelLoadError(f"GPTQ with bits={bits} is not served (4 and 8 bits are)")
        fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
        if config.get("is_marlin_format"):
            fmt = "marlin"
        if fmt not in FORMATS:
            raise ModelLoadError(
                f"GPTQ checkpoint_format {fmt!r} is not served (only {', '.join(FORMATS)})"
            )
        if config.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
            raise ModelLoadError(f"GPTQ pack_dtype {config['pack_dtype']!r} is not served (int32)")
        if config.get("dynamic"):
            raise ModelLoadError("GPTQ with per-module overrides (dynamic) is not served")
        if config.get("lm_head"):
            raise ModelLoadError("GPTQ with a quantized lm_head is not served")
        group_size = config.get("group_size", 128)
        if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
            raise ModelLoadError(f"GPTQ group_size {group_size!r} is not served")
        return cls(bits=bits, group_size=group_size, v2=fmt == "gptq_v2")

    def read(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        """One projection's tensors as a ``QuantizedWeight``."""
        per = 32 // self.bits
        qweight = tensor(tensors, module, "qweight")
        if qweight.dim() != 2:
            raise ModelLoadError(f"{module}.qweight must be 2-D, not {list(qweight.shape)}")
        in_features, out_features = qweight.shape[0] * per, qweight.shape[1]
        groups = 1 if self.group_size == -1 else -(-in_features // self.group_size)
        if out_features % per:
            raise ModelLoadError(f"{module}: {out_features} outputs do not pack {per} a word")
        expect(qweight, f"{module}.qweight", (in_features // per, out_features), (torch.int32,))
        qzeros = tensor(tensors, module, "qzeros")
        expect(qzeros, f"{module}.qzeros", (groups, out_features // per), (torch.int32,))
        scales = tensor(tensors, module, "scales")
        expect(scales, f"{module}.scales", (groups, out_features), FLOATS)
        levels = unpack_int32(qweight, self.bits, 0).t().contiguous()  # [out, in]
        if not self.v2:
            qzeros = _v1_to_v2(qzeros, self.bits)
        zeros = unpack_int32(qzeros, self.bits, 1).float()  # [groups, out]
        return grouped_weight(
            levels,
            scales_fp32(scales, f"{module}.scales").t().contiguous(),
            zeros.t().contiguous(),
            tensors.get("g_idx"),
            bits=self.bits,
            where=module,
        )


def _v1_to_v2(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """v1's zero words as v2 stores them: each word plus one in every field, modulo 2**32."""
    words = (qzeros.to(torch.int64) + ONES[bits]) % 2**32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
