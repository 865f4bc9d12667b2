"""AWQ checkpoints (Lin et al., MLSys 2024) in AutoAWQ's GEMM packing, as transformers and
GPTQModel read them.

Per quantized projection [out, in]: ``qweight`` int32 [in, out / 8] and ``qzeros`` int32
[in / group, out / 8], eight output features a word in the interleaved order ``AWQ_ORDER`` (the
word's k-th nibble holds feature ``AWQ_ORDER[k]`` of its eight), ``scales`` fp16 [in / group, out];
``w[o, i] = (q[i, o] - z[i // group, o]) * scales[i // group, o]``. Served: 4 bits, GEMM packing,
with zero points. Refused by name: GEMV, GEMV-fast, Marlin, ExLlama and IPEX packings, llm-awq's
own layout, and ``zero_point: false``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from switchboard_kernels.quantized_weight import QuantizedWeight
from worker.errors import ModelLoadError
from worker.model.quantized_checkpoints.packing import (
    FLOATS,
    expect,
    scales_fp32,
    tensor,
    unpack_int32,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds output feature AWQ_ORDER[k]
# column c of a word's eight is nibble AWQ_COLUMNS[c]
AWQ_COLUMNS = tuple(AWQ_ORDER.index(c) for c in range(8))


@dataclass(frozen=True, slots=True)
class AwqReader:
    method: ClassVar[str] = "awq"
    tensor_names: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales")

    group_size: int  # -1: one group per output feature

    @classmethod
    def from_config(cls, config: dict) -> AwqReader:
        """The reader for ``quantization_config``, or a refusal naming the option not served."""
        bits = config.get("bits", config.get("w_bit"))
        if bits != 4:
            raise ModelLoadError(f"AWQ with bits={bits} is not served (4 bits is)")
        version = str(config.get("version") or "gemm").lower()
        if version != "gemm":
            raise ModelLoadError(f"AWQ version {version!r} is not served (only the GEMM packing)")
        backend = str(config.get("backend") or "autoawq").lower()
        if backend != "autoawq":  # llm-awq packs its own way
            raise ModelLoadError(f"AWQ backend {backend!r} is not served (only AutoAWQ's packing)")
        if not config.get("zero_point", True):
            raise ModelLoadError("AWQ without zero points (zero_point: false) is not served")
        group_size = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
            raise ModelLoadError(f"AWQ group_size {group_size!r} is not served")
        return cls(group_size=group_size)

    def read(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        """One projection's tensors as a ``QuantizedWeight``."""
        qweight = tensor(tensors, module, "qweight")
        if qweight.dim() != 2:
            raise ModelLoadError(f"{module}.qweight must be 2-D, not {list(qweight.shape)}")
        in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
        group_size = in_features if self.group_size == -1 else self.group_size
        if in_features % group_size:
            raise ModelLoadError(f"{module}: group size {group_size} does not divide {in_features}")
        groups = in_features // group_size
        expect(qweight, f"{module}.qweight", (in_features, out_features // 8), (torch.int32,))
        qzeros = tensor(tensors, module, "qzeros")
        expect(qzeros, f"{module}.qzeros", (groups, out_features // 8), (torch.int32,))
        scales = tensor(tensors, module, "scales")
        expect(scales, f"{module}.scales", (groups, out_features), FLOATS)
        levels = _unpack_awq(qweight).t().contiguous()  # [out, in]
        zeros = _unpack_awq(qzeros).t().float().contiguous()  # [out, groups]
        scales = scales_fp32(scales, f"{module}.scales").t().contiguous()
        return QuantizedWeight(levels, scales, zeros, 4, group_size)


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[rows, words] int32 -> [rows, 8 * words] uint8 in output-feature order."""
    rows, words = packed.shape
    nibbles = unpack_int32(packed, 4, 1).view(rows, words, 8)
    return nibbles[..., list(AWQ_COLUMNS)].reshape(rows, words * 8)
