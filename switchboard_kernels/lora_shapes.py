"""The shape checks every multi-LoRA path runs before it touches memory (the Triton kernels
index raw pointers: a wrong shape would read or write out of bounds, not fail). The layout
they check is in ``lora_reference.py``'s docstring."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_shrink(x: torch.Tensor, a_stack: torch.Tensor) -> None:
    if x.dim() != 2 or a_stack.dim() != 3 or a_stack.shape[2] != x.shape[1]:
        raise ValueError(
            f"shrink: x {tuple(x.shape)} does not match a_stack {tuple(a_stack.shape)}"
        )


def check_expand(
    y: torch.Tensor, x_shape: Sequence[int], b_stack: torch.Tensor, out_offset: int
) -> None:
    """``x_shape``: the shrink output's [tokens, rank] (a shape, so a fused kernel whose
    shrink output never exists checks the same)."""
    x_shape = tuple(x_shape)
    if len(x_shape) != 2 or b_stack.dim() != 3 or b_stack.shape[2] != x_shape[1]:
        raise ValueError(f"expand: x {x_shape} does not match b_stack {tuple(b_stack.shape)}")
    if y.dim() != 2 or y.shape[0] != x_shape[0]:
        raise ValueError(f"expand: y {tuple(y.shape)} and x {x_shape} differ in tokens")
    if out_offset < 0 or out_offset + b_stack.shape[1] > y.shape[1]:
        raise ValueError(
            f"expand: columns [{out_offset}, {out_offset + b_stack.shape[1]}) "
            f"outside y {tuple(y.shape)}"
        )


# --- references -------------------------------------------------------------------------
