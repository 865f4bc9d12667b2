"""Batched multi-LoRA in plain torch: the references for the Triton kernels, and CPU paths.

Punica (Chen et al., "Punica: Multi-Tenant LoRA Serving", MLSys 2024) splits one LoRA
``y += scale * x @ A.T @ B.T`` over a batch of mixed adapters into two batched ops:
*shrink* ``x @ A.T`` down to the rank, then *expand* ``@ B.T`` back up, added into y.
BGMV gathers each token's adapter (decode); SGMV works on contiguous segments of tokens
that share one adapter (prefill).

Layout (shared with ``switchboard_kernels/lora_triton.py`` and the LoRA manager):
- ``a_stack`` [num_slots, max_rank, in_features]: PEFT's ``lora_A.weight`` ([r, in]) per
  device slot, rows >= r zero;
- ``b_stack`` [num_slots, out_features, max_rank]: ``lora_B.weight`` ([out, r]), columns
  >= r zero;
- ``scales`` [num_slots] float32: alpha / r per slot, applied in expand;
- slot ``-1`` means "no adapter": shrink writes zeros there and expand leaves the row as is.

The four references compute in fp32 and round once; any rank and any shape are accepted.
The fused (shrink + expand) CPU paths that ``switchboard_kernels/lora.py`` dispatches to are
in ``lora_torch.py``; the shape checks every path runs, in ``lora_shapes.py``.
"""

from __future__ import annotations

import torch

from switchboard_kernels.lora_shapes import check_expand, check_shrink


def bgmv_shrink(
    x: torch.Tensor,  # [T, in] float
    a_stack: torch.Tensor,  # [S, R, in], x's dtype
    token_slots: torch.Tensor,  # [T] int64, -1 = no adapter
) -> torch.Tensor:  # [T, R], x's dtype
    """Semantics: ``out[t] = x[t] @ a_stack[s_t].T`` if ``s_t >= 0`` else 0."""
    check_shrink(x, a_stack)
    a = a_stack[token_slots.clamp(min=0)].float()  # [T, R, in]: each token's own A
    out = torch.einsum("ti,tri->tr", x.float(), a)
    return out.masked_fill(token_slots[:, None] < 0, 0).to(x.dtype)


def bgmv_expand(
    y: torch.Tensor,  # [T, out_total], updated in place
    x: torch.Tensor,  # [T, R], the shrink output
    b_stack: torch.Tensor,  # [S, out, R]
    token_slots: torch.Tensor,  # [T] int64, -1 = no adapter
    scales: torch.Tensor,  # [S] float32
    *,
    out_offset: int = 0,
) -> None:
    """Semantics: ``y[t, o:o+out] += scales[s_t] * (x[t] @ b_stack[s_t].T)`` for ``s_t >= 0``."""
    check_expand(y, x.shape, b_stack, out_offset)
    rows = (token_slots >= 0).nonzero().squeeze(1)
    slots = token_slots[rows]
    delta = torch.einsum("tr,tor->to", x[rows].float(), b_stack[slots].float())
    delta *= scales[slots].float()[:, None]
    cols = slice(out_offset, out_offset + b_stack.shape[1])
    y[rows, cols] = (y[rows, cols].float() + delta).to(y.dtype)


def sgmv_shrink(
    x: torch.Tensor,  # [T, in] float
    a_stack: torch.Tensor,  # [S, R, in]
    seg_starts: torch.Tensor,  # [num_segments + 1] int64, non-decreasing token offsets
    seg_slots: torch.Tensor,  # [num_segments] int64, -1 = no adapter
    *,
    max_seg_len: int | None = None,  # launch-grid hint for the kernel; unused here
) -> torch.Tensor:  # [T, R], x's dtype
    """Semantics: ``out[i:j] = x[i:j] @ a_stack[s].T`` per segment [i, j) of slot s >= 0, else 0."""
    check_shrink(x, a_stack)
    out = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32)
    starts, slots = seg_starts.tolist(), seg_slots.tolist()
    for seg, slot in enumerate(slots):
        i, j = starts[seg], starts[seg + 1]
        if slot >= 0 and j > i:
            out[i:j] = x[i:j].float() @ a_stack[slot].float().T
    return out.to(x.dtype)


def sgmv_expand(
    y: torch.Tensor,  # [T, out_total], updated in place
    x: torch.Tensor,  # [T, R]
    b_stack: torch.Tensor,  # [S, out, R]
    seg_starts: torch.Tensor,  # [num_segments + 1] int64
    seg_slots: torch.Tensor,  # [num_segments] int64, -1 = no adapter
    scales: torch.Tensor,  # [S] float32
    *,
    out_offset: int = 0,
    max_seg_len: int | None = None,  # launch-grid hint for the kernel; unused here
) -> None:
    """Semantics: ``y[i:j, o:o+out] += scales[s] * (x[i:j] @ b_stack[s].T)`` per segment, s >= 0."""
    check_expand(y, x.shape, b_stack, out_offset)
    cols = slice(out_offset, out_offset + b_stack.shape[1])
    starts, slots = seg_starts.tolist(), seg_slots.tolist()
    for seg, slot in enumerate(slots):
        i, j = starts[seg], starts[seg + 1]
        if slot >= 0 and j > i:
            delta = x[i:j].float() @ b_stack[slot].float().T * scales[slot].float()
            y[i:j, cols] = (y[i:j, cols].float() + delta).to(y.dtype)


def dora_rescale(
    y: torch.Tensor,  # [T, >= out], updated in place
    scales: torch.Tensor,  # [S, out] float32: each slot's DoRA factor
    enabled: torch.Tensor,  # [S] int64: 1 where the slot's adapter is DoRA
    token_slots: torch.Tensor,  # [T] int64, -1 = no adapter
    *,
    base: torch.Tensor | None = None,  # [out] or [T, out]: the part of y not to rescale
) -> None:
    """Semantics: ``y[t, :out] = z_t + scales[s_t] * (y[t, :out] - z_t)`` for ``s_t >= 0`` with
    ``enabled[s_t]`` (z = base, or 0); other rows untouched (``lora_dora.py``)."""
    out = scales.shape[1]
    slots = token_slots.clamp(min=0)
    use = (token_slots >= 0) & (enabled[slots] != 0)
    rows = use.nonzero().squeeze(1)
    g = scales[slots[rows]].float()  # [n, out]: each row's own factor
    v = y[rows, :out].float()
    if base is not None:
        z = (base[None, :] if base.dim() == 1 else base[rows]).float()
        v = z + g * (v - z)
    else:
        v = g * v
    y[rows, :out] = v.to(y.dtype)
