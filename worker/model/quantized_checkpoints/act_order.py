"""GPTQ's act-order (``desc_act``; compressed-tensors' ``actorder: group``) as a QuantizedWeight.

Such a checkpoint quantized its input features in order of decreasing activation and stores the
group of every feature in ``g_idx`` [in], the features themselves in their original order. A
``QuantizedWeight`` wants each group contiguous: its columns are the features sorted by group
(stably), ``input_order`` saying which feature each column multiplies.
"""

from __future__ import annotations

import torch

from switchboard_kernels.quantized_weight import QuantizedWeight
from worker.errors import ModelLoadError


def grouped_weight(
    levels: torch.Tensor,  # [out, in] uint8, input features in checkpoint order
    scales: torch.Tensor,  # [out, groups] fp32
    zeros: torch.Tensor,  # [out, groups] fp32
    g_idx: torch.Tensor | None,  # [in]: each input feature's group; None: in order
    *,
    bits: int,
    where: str,
) -> QuantizedWeight:
    """The weight whose input feature i takes group ``g_idx[i]``'s scale and zero."""
    in_features, groups = levels.shape[1], scales.shape[1]
    if in_features % groups:
        raise ModelLoadError(f"{where}: {groups} groups do not divide {in_features} inputs")
    size = in_features // groups
    if g_idx is None:
        return QuantizedWeight(levels, scales, zeros, bits, size)
    if tuple(g_idx.shape) != (in_features,) or g_idx.dtype.is_floating_point:
        raise ModelLoadError(f"{where}.g_idx must be {in_features} integers, not {g_idx.dtype}")
    g_idx = g_idx.to(torch.int64)
    if bool((g_idx < 0).any()) or bool((g_idx >= groups).any()):
        raise ModelLoadError(f"{where}.g_idx names groups outside 0..{groups - 1}")
    if torch.equal(g_idx, torch.arange(in_features) // size):
        return QuantizedWeight(levels, scales, zeros, bits, size)
    if bool((torch.bincount(g_idx, minlength=groups) != size).any()):
        raise ModelLoadError(f"{where}.g_idx groups are not all of {size} input features")
    order = torch.argsort(g_idx, stable=True)
    return QuantizedWeight(levels[:, order].contiguous(), scales, zeros, bits, size, order)
