"""A weight-only quantized projection weight, as every quantized base reaches the kernels.

Semantics: ``w[o, order[j]] = (levels[o, j] - zeros[o, g]) * scales[o, g]``, g = j // group_size,
``order`` being ``input_order`` (GPTQ's act-order: its columns regrouped so that each group is
contiguous) or the identity. The published formats' readers (GPTQ, AWQ, compressed-tensors) and
quantization on load (``quantize``) produce it; ``switchboard_kernels.linear.Linear`` packs it for
its kernels. Levels stay unpacked here (one per byte) so that concatenating, slicing for tensor
parallelism and repacking are plain tensor indexing; the kernels' layouts are theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (4, 8)
FP16_SMALLEST_NORMAL = 2.0**-14


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    levels: torch.Tensor  # [out, in] uint8 in 0 .. 2**bits - 1, columns in ``input_order``
    scales: torch.Tensor  # [out, groups] fp32
    zeros: torch.Tensor  # [out, groups] fp32, in levels (2**(bits - 1) when symmetric)
    bits: int
    group_size: int  # input features per scale; in_features: one per output feature
    input_order: torch.Tensor | None = None  # [in] int64: the feature column j multiplies

    def __post_init__(self) -> None:
        out_features, in_features = self.levels.shape
        if self.bits not in BITS:
            raise ValueError(f"{self.bits}-bit weights: only {BITS} are served")
        if self.levels.dtype != torch.uint8:
            raise ValueError(f"levels must be uint8, not {self.levels.dtype}")
        if self.group_size <= 0 or in_features % self.group_size:
            raise ValueError(f"group size {self.group_size} does not divide {in_features} inputs")
        groups = (out_features, in_features // self.group_size)
        for name in ("scales", "zeros"):
            t = getattr(self, name)
            if tuple(t.shape) != groups or t.dtype != torch.float32:
                shape = list(t.shape)
                raise ValueError(f"{name} must be fp32 {list(groups)}, not {t.dtype} {shape}")
        if self.input_order is not None and tuple(self.input_order.shape) != (in_features,):
            raise ValueError(f"input_order must have {in_features} entries")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.levels.shape)  # type: ignore[return-value]

    @property
    def packed_bytes(self) -> int:
        """What a kernel streams per pass: levels at ``bits`` each, a scale and a zero per group."""
        return self.levels.numel() * self.bits // 8 + 2 * self.scales.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] in the checkpoint's input order (the torch reference's weight)."""
        out_features, in_features = self.shape
        groups = in_features // self.group_size
        levels = self.levels.float().view(out_features, groups, self.group_size)
        w = ((levels - self.zeros[..., None]) * self.scales[..., None]).view(out_features, -1)
        if self.input_order is not None:
            w = torch.empty_like(w).index_copy_(1, self.input_order, w)
        return w.to(dtype)

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Output features ``start:stop`` (a column-parallel shard)."""
        return QuantizedWeight(
            self.levels[start:stop].contiguous(),
            self.scales[start:stop].contiguous(),
            self.zeros[start:stop].contiguous(),
            self.bits,
            self.group_size,
            self.input_order,
        )

    def columns(self, start: int, stop: int) -> QuantizedWeight:
        """Input features ``start:stop`` (a row-parallel shard): whole groups, stored order only."""
        if self.input_order is not None:
            raise ValueError("an act-order weight's input features cannot be split")
        if start % self.group_size or stop % self.group_size:
            raise ValueError(f"inputs {start}:{stop} split a group of {self.group_size}")
        g0, g1 = start // self.group_size, stop // self.group_size
        return QuantizedWeight(
            self.levels[:, start:stop].contiguous(),
            self.scales[:, g0:g1].contiguous(),
            self.zeros[:, g0:g1].contiguous(),
            self.bits,
            self.group_size,
        )


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Projections that read the same input stacked by output features (q/k/v, gate/up)."""
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size) != (first.bits, first.group_size):
            raise ValueError("fused projections quantized alike are required (bits, group size)")
        same_order = (p.input_order is None and first.input_order is None) or (
            p.input_order is not None
            and first.input_order is not None
            and torch.equal(p.input_order, first.input_order)
        )
        if not same_order:
            raise ValueError("fused projections with different act-order (g_idx) are not served")
    return QuantizedWeight(
        torch.cat([p.levels for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.zeros for p in parts]),
        first.bits,
        first.group_size,
        first.input_order,
    )


def fp16_scales(scales: torch.Tensor) -> torch.Tensor | None:
    """``scales`` rounded to fp16 values, or None where one would leave fp16's normal range
    (a subnormal keeps fewer digits; past 65504 it is infinite)."""
    rounded = scales.half().float()
    normal = (scales == 0) | (rounded.isfinite() & (rounded >= FP16_SMALLEST_NORMAL))
    return rounded if bool(normal.all()) else None


def quantize(
    weight: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    symmetric: bool,
    integer_zero: bool = True,
    fp16_params: bool = False,
) -> QuantizedWeight:
    """Round to nearest, per group of ``group_size`` input features (``weight.shape[1]``: per
    output feature). Symmetric: zero 2**(bits-1), scale max|w| / (2**(bits-1) - 1); else the
    group's range over 2**bits - 1 levels with an integer zero (GPTQ's and AWQ's convention:
    the range stretched to hold 0). ``integer_zero=False`` (asymmetric only): the levels span
    the group's own minimum to maximum, the zero a float (llama.cpp's Q4_1 and HQQ's grid),
    every level inside the range. ``fp16_params``: the scales (and float zeros) are fp16
    values, as GPTQ and AWQ store theirs, and the levels rounded on that grid, so the native
    kernel holds them in 2 bytes (wq_native.pack); where one would not fit fp16 (or a float
    zero would move by more than 1/64 of a step) the weight keeps fp32 ones."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"group size {group_size} does not divide {in_features} inputs")
    w = weight.float().view(out_features, in_features // group_size, group_size)
    top = 2**bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        scales = _on_fp16_grid(w.abs().amax(-1) / (half - 1), fp16_params)
        zeros = torch.full_like(scales, float(half))
    elif integer_zero:
        low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scales = _on_fp16_grid((high - low) / top, fp16_params)
        zeros = torch.where(scales > 0, torch.round(-low / scales), 0.0).clamp(0, top)
    else:  # a constant group: scale 1, level 0 is its value
        low, high = w.amin(-1), w.amax(-1)
        scales = torch.where(high > low, (high - low) / top, 1.0)
        rounded = fp16_scales(scales) if fp16_params else None
        if rounded is not None:
            zeros = (-low / rounded).half().float()
            if float((zeros + low / rounded).abs().max()) <= 2.0**-6:
                levels = torch.round(w / rounded[..., None] + zeros[..., None])
                return _rounded(levels, rounded, zeros, bits, group_size)
        zeros = -low / scales
        levels = torch.round((w - low[..., None]) / scales[..., None])
        return _rounded(levels, scales, zeros, bits, group_size)
    safe = torch.where(scales > 0, scales, 1.0)
    levels = torch.round(w / safe[..., None]) + zeros[..., None]
    return _rounded(levels, scales, zeros, bits, group_size)


def _on_fp16_grid(scales: torch.Tensor, fp16_params: bool) -> torch.Tensor:
    """``scales`` rounded to fp16 values where asked and they fit (``fp16_scales``), else as
    they are."""
    rounded = fp16_scales(scales) if fp16_params else None
    return scales if rounded is None else rounded


def _rounded(
    levels: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int
) -> QuantizedWeight:
    """The rounded levels [out, groups, group] clamped to ``bits`` as a QuantizedWeight."""
    out_features = levels.shape[0]
    levels = levels.clamp(0, 2**bits - 1).to(torch.uint8).view(out_features, -1)
    return QuantizedWeight(levels, scales.contiguous(), zeros.contiguous(), bits, group_size)
