"""compressed-tensors checkpoints (llm-compressor's format) in its ``pack-quantized`` layout,
weight-only.

Per quantized projection [out, in] with ``per = 32 // bits``: ``weight_packed`` int32
[out, ceil(in / per)] (input features packed, the last word padded), ``weight_scale`` [out, groups]
(one group: per channel), ``weight_zero_point`` int32 [ceil(out / per), groups] (output features
packed; asymmetric schemes only), ``weight_shape`` [2]. Levels are stored offset by
``2**(bits - 1)`` (signed ints made unsigned), zero points alike, so in stored levels
``w = (q - z) * scale`` with z = ``2**(bits - 1)`` when symmetric. Served: int weights of 4 or 8
bits, per channel or per group, symmetric or not. Refused by name: activation or KV cache
quantization, float types (FP8, NVFP4, MXFP4), other strategies (tensor, block), other formats
(int-quantized, float-quantized, marlin-24, ...), sparsity, transforms, act-order groups
(``weight_g_idx``, dropped from compressed-tensors itself).
"""

from __future__ import annotations

import re
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

FORMAT = "pack-quantized"
INTEGERS = (torch.int32, torch.int64, torch.int16, torch.int8)


@dataclass(frozen=True, slots=True)
class Scheme:
    """One config group's weights: what its ``targets`` name, how they are quantized."""

    targets: tuple[str, ...]
    bits: int
    group_size: int | None  # None: per output channel
    symmetric: bool

    @classmethod
    def from_config(cls, name: str, group: dict, default_format: str) -> Scheme:
        where = f"compressed-tensors config group {name!r}"
        fmt = group.get("format") or default_format
        if fmt != FORMAT:
            raise ModelLoadError(f"{where}: format {fmt!r} is not served (only {FORMAT})")
        for activations in ("input_activations", "output_activations"):
            if group.get(activations):
                raise ModelLoadError(
                    f"{where}: {activations} quantization is not served (weight-only only)"
                )
        w = group.get("weights")
        if not w:
            raise ModelLoadError(f"{where} quantizes no weights")
        if w.get("type", "int") != "int":
            raise ModelLoadError(f"{where}: {w['type']} weights are not served (int only)")
        bits = w.get("num_bits", 8)
        if bits not in (4, 8):
            raise ModelLoadError(f"{where}: num_bits={bits} is not served (4 and 8 are)")
        strategy = w.get("strategy") or "tensor"
        if strategy not in ("channel", "group"):
            raise ModelLoadError(
                f"{where}: strategy {strategy!r} is not served (channel and group are)"
            )
        if w.get("dynamic"):
            raise ModelLoadError(f"{where}: dynamic weight quantization is not served")
        if w.get("actorder") == "group":
            raise ModelLoadError(f"{where}: actorder 'group' (weight_g_idx) is not served")
        group_size = w.get("group_size") if strategy == "group" else None
        if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
            raise ModelLoadError(f"{where}: group_size {group_size!r} is not served")
        targets = tuple(group.get("targets") or ())
        return cls(targets, bits, group_size, bool(w.get("symmetric", True)))

    def priority(self, module: str) -> int | None:
        """How closely ``targets`` name ``module`` (0 its name, 1 a regex, 2 any Linear), or
        None: not at all (compressed-tensors' own precedence)."""
        best = None
        for t in self.targets:
            rank = None
            if t == module:
                rank = 0
            elif t.startswith("re:") and re.match(t[3:], module):
                rank = 1
            elif t == "Linear":
                rank = 2
            if rank is not None and (best is None or rank < best):
                best = rank
        return best


@dataclass(frozen=True, slots=True)
class CompressedTensorsReader:
    method: ClassVar[str] = "compressed-tensors"
    tensor_names: ClassVar[tuple[str, ...]] = (
        "weight_packed",
        "weight_scale",
        "weight_zero_point",
        "weight_shape",
        "weight_g_idx",
    )

    schemes: tuple[Scheme, ...]

    @classmethod
    def from_config(cls, config: dict) -> CompressedTensorsReader:
        """The reader for ``quantization_config``, or a refusal naming the option not served."""
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise ModelLoadError(
                f"compressed-tensors quantization_status {status!r} is not served (compressed)"
            )
        if config.get("kv_cache_scheme"):
            raise ModelLoadError(
                "compressed-tensors kv_cache_scheme (KV quantization) is not served"
            )
        sparsity = config.get("sparsity_config") or {}
        if sparsity and sparsity.get("format", "dense") != "dense":
            raise ModelLoadError(
                f"compressed-tensors sparsity format {sparsity.get('format')!r} is not served"
            )
        if config.get("transform_config"):
            raise ModelLoadError("compressed-tensors transforms (transform_config) are not served")
        fmt = config.get("format") or FORMAT
        groups = config.get("config_groups") or {}
        if not groups:
            raise ModelLoadError("compressed-tensors config without config_groups")
        schemes = tuple(Scheme.from_config(n, g, fmt) for n, g in sorted(groups.items()))
        return cls(schemes)

    def scheme(self, module: str) -> Scheme:
        """The config group that quantized ``module``."""
        ranked = [(p, s) for s in self.schemes if (p := s.priority(module)) is not None]
        if not ranked:
            if len({(s.bits, s.group_size, s.symmetric) for s in self.schemes}) == 1:
                return self.schemes[0]  # targets we cannot read (a class name): one scheme
            raise ModelLoadError(f"no compressed-tensors config group targets {module}")
        best = min(p for p, _ in ranked)
        found = {s for p, s in ranked if p == best}
        if len(found) > 1:
            raise ModelLoadError(f"several compressed-tensors config groups target {module}")
        return found.pop()

    def read(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        """One projection's tensors as a ``QuantizedWeight``."""
        s = self.scheme(module)
        if "weight_g_idx" in tensors:
            raise ModelLoadError(f"{module}.weight_g_idx: act-order groups are not served")
        per = 32 // s.bits
        shape = tensor(tensors, module, "weight_shape")
        if shape.dtype not in INTEGERS or tuple(shape.shape) != (2,) or bool((shape <= 0).any()):
            raise ModelLoadError(f"{module}.weight_shape must be two positive integers")
        out_features, in_features = (int(v) for v in shape)
        group_size = s.group_size or in_features
        if in_features % group_size:
            raise ModelLoadError(f"{module}: group size {group_size} does not divide {in_features}")
        groups = in_features // group_size
        packed = tensor(tensors, module, "weight_packed")
        expect(
            packed,
            f"{module}.weight_packed",
            (out_features, -(-in_features // per)),
            (torch.int32,),
        )
        scale = tensor(tensors, module, "weight_scale")
        expect(scale, f"{module}.weight_scale", (out_features, groups), FLOATS)
        levels = unpack_int32(packed, s.bits, 1)[:, :in_features].contiguous()
        if s.symmetric:
            zeros = torch.full((out_features, groups), float(2 ** (s.bits - 1)))
        else:
            zp = tensor(tensors, module, "weight_zero_point")
            rows = -(-out_features // per)
            expect(zp, f"{module}.weight_zero_point", (rows, groups), (torch.int32,))
            zeros = unpack_int32(zp, s.bits, 0)[:out_features].float().contiguous()
        return QuantizedWeight(
            levels, scales_fp32(scale, f"{module}.weight_scale"), zeros, s.bits, group_size
        )
