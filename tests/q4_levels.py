"""The 4-bit kernel's arithmetic as specified (switchboard_kernels/q4_cpu.c): the levels a weight
and an activation row are rounded to, as float64 tensors. The oracles of the q4, linear and draft
tests."""

from __future__ import annotations

import torch

from switchboard_kernels.q4_native import GROUP


def weight_levels(weight: torch.Tensor) -> torch.Tensor:
    """The weight as specified: per output and group of 64 input features, 16 levels from
    the group's minimum (rounded to fp16) by an fp16 step of (max - min) / 15, each weight
    on its nearest level. In fp32, as the packing computes it (fp64 would break some ties
    between levels the other way)."""
    out_features, in_features = weight.shape
    w = weight.float().view(out_features, -1, GROUP)
    low = w.amin(-1, keepdim=True).half().float()
    step = ((w.amax(-1, keepdim=True) - low) / 15).half().float()
    q = torch.where(step > 0, torch.round((w - low) / step), 0.0).clamp(0, 15)
    return (low.double() + q.double() * step.double()).view(out_features, in_features)


def activation_levels(x: torch.Tensor) -> torch.Tensor:
    """The rows as the kernel multiplies them: per row and group of 64 features, int8
    levels of max |x| / 127, each value rounded to the nearest (ties away from zero)."""
    rows, in_features = x.shape
    g = x.float().view(rows, -1, GROUP)
    amax = g.abs().amax(-1, keepdim=True)
    scaled = g * torch.where(amax > 0, 127.0 / amax, 0.0)
    q = torch.trunc(scaled + torch.where(scaled < 0, -0.5, 0.5)).clamp(-127, 127)
    return (q.double() * (amax.double() / 127)).view(rows, in_features)
