"""Batched multi-LoRA in plain torch: the references for the Triton kernels, and CPU paths.

Punica (Chen et al., "Punica: Multi-Tenant LoRA Serving", MLSys 2024) splits one LoRA
``y += scale * x @ A.T @ B.T`` over a batch of mixed adapters into two batched ops:
*shrink* ``x @ A.T`` down to the rank, then *expand* ``@ B.T`` back up, added into y.
BGMV gathers each token's adapter (decode); SGMV works on contiguous segments of tokens
that share one adapter (prefill).

Layout (shared with ``kernels/lora_triton.py`` and the LoRA manager):
- ``a_stack`` [num_slots, max_rank, in_features]: PEFT's ``lora_A.weight`` ([r, in]) per
  device slot, rows >= r zero;
- ``b_stack`` [num_slots, out_features, max_rank]: ``lora_B.weight`` ([out, r]), columns
  >= r zero;
- ``scales`` [num_slots] float32: alpha / r per slot, applied in expand;
- slot ``-1`` means "no adapter": shrink writes zeros there and expand leaves the row as is.

The four references compute in fp32 and round once; any rank and any shape are accepted.
The ``lora_*`` functions below them are the fused (shrink + expand) CPU candidates that
``bench/lora_ops.py`` measures and ``kernels/lora.py`` picks from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_shrink(x: torch.Tensor, a_stack: torch.Tensor) -> None:
    if x.dim() != 2 or a_stack.dim() != 3 or a_stack.shape[2] != x.shape[1]:
        raise ValueError(
            f"shrink: x {tuple(x.shape)} does not match a_stack {tuple(a_stack.shape)}"
        )


def check_expand(y: torch.Tensor, x: torch.Tensor, b_stack: torch.Tensor, out_offset: int) -> None:
    if x.dim() != 2 or b_stack.dim() != 3 or b_stack.shape[2] != x.shape[1]:
        raise ValueError(
            f"expand: x {tuple(x.shape)} does not match b_stack {tuple(b_stack.shape)}"
        )
    if y.dim() != 2 or y.shape[0] != x.shape[0]:
        raise ValueError(f"expand: y {tuple(y.shape)} and x {tuple(x.shape)} differ in tokens")
    if out_offset < 0 or out_offset + b_stack.shape[1] > y.shape[1]:
        raise ValueError(
            f"expand: columns [{out_offset}, {out_offset + b_stack.shape[1]}) "
            f"outside y {tuple(y.shape)}"
        )


# --- references -------------------------------------------------------------------------


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
    check_expand(y, x, b_stack, out_offset)
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
    check_expand(y, x, b_stack, out_offset)
    cols = slice(out_offset, out_offset + b_stack.shape[1])
    starts, slots = seg_starts.tolist(), seg_slots.tolist()
    for seg, slot in enumerate(slots):
        i, j = starts[seg], starts[seg + 1]
        if slot >= 0 and j > i:
            delta = x[i:j].float() @ b_stack[slot].float().T * scales[slot].float()
            y[i:j, cols] = (y[i:j, cols].float() + delta).to(y.dtype)


# --- fused CPU candidates: y[:, o:o+out] += scale * (x @ A.T) @ B.T ----------------------
# Each takes the host-side batch description that LoraMapping prepares once per step (no
# device sync, no Python loop over tokens) and computes in `compute_dtype`: on CPU a tiny
# bf16 matmul costs ~25 us of oneDNN overhead where fp32 costs ~5 us, so small batches run
# in fp32 even for a bf16 model (see bench/lora_ops.py).


def lora_segments(
    y: torch.Tensor,  # [T, out_total], updated in place
    x: torch.Tensor,  # [T, in]
    a_stack: torch.Tensor,  # [S, R, in]
    b_stack: torch.Tensor,  # [S, out, R]
    scales: torch.Tensor,  # [S] float32
    segments: list[tuple[int, int, int]],  # (start, end, slot >= 0): runs of one adapter
    *,
    out_offset: int = 0,
    compute_dtype: torch.dtype = torch.float32,
) -> None:
    """SGMV in torch: two matmuls per run of tokens, no gather (option a)."""
    yc = y[:, out_offset : out_offset + b_stack.shape[1]]
    xc = x.to(compute_dtype)
    scale = scales.tolist()
    for i, j, slot in segments:
        h = F.linear(xc[i:j], a_stack[slot].to(compute_dtype))  # [j - i, R]
        b = b_stack[slot].to(compute_dtype)
        if y.dtype == compute_dtype:  # accumulate straight into y, no [n, out] temporary
            yc[i:j].addmm_(h, b.T, alpha=scale[slot])
        else:
            yc[i:j].add_(F.linear(h, b), alpha=scale[slot])


def lora_gathered(
    y: torch.Tensor,  # [T, out_total], updated in place
    x: torch.Tensor,  # [T, in]
    a_stack: torch.Tensor,  # [S, R, in]
    b_stack: torch.Tensor,  # [S, out, R]
    scales: torch.Tensor,  # [S] float32
    lora_rows: torch.Tensor,  # [N] int64: tokens with an adapter
    lora_slots: torch.Tensor,  # [N] int64: their slots
    *,
    out_offset: int = 0,
    compute_dtype: torch.dtype = torch.float32,
) -> None:
    """BGMV in torch: a copy of A and B per token, two batched matmuls (option b)."""
    xs = x.index_select(0, lora_rows).to(compute_dtype)[:, None, :]  # [N, 1, in]
    a = a_stack.index_select(0, lora_slots).to(compute_dtype)  # [N, R, in]
    h = torch.bmm(xs, a.transpose(1, 2))  # [N, 1, R]
    h *= scales.index_select(0, lora_slots).to(compute_dtype)[:, None, None]
    b = b_stack.index_select(0, lora_slots).to(compute_dtype)  # [N, out, R]
    d = torch.bmm(h, b.transpose(1, 2)).squeeze(1)  # [N, out]
    yc = y[:, out_offset : out_offset + b_stack.shape[1]]
    yc.index_add_(0, lora_rows, d.to(y.dtype))


def lora_grouped(
    y: torch.Tensor,  # [T, out_total], updated in place
    x: torch.Tensor,  # [T, in]
    a_stack: torch.Tensor,  # [S, R, in]
    b_stack: torch.Tensor,  # [S, out, R]
    scales: torch.Tensor,  # [S] float32
    order: torch.Tensor,  # [N] int64: tokens with an adapter, grouped by slot
    groups: list[tuple[int, int]],  # (slot, count) of each group, in `order`
    *,
    out_offset: int = 0,
    compute_dtype: torch.dtype = torch.float32,
) -> None:
    """Sort by slot, two matmuls per distinct adapter, scatter back (option c)."""
    xs = x.index_select(0, order).to(compute_dtype)  # [N, in]
    d = torch.empty(xs.shape[0], b_stack.shape[1], dtype=compute_dtype)  # [N, out]
    scale = scales.tolist()
    i = 0
    for slot, n in groups:
        h = F.linear(xs[i : i + n], a_stack[slot].to(compute_dtype))  # [n, R]
        b = b_stack[slot].to(compute_dtype)
        d[i : i + n].addmm_(h, b.T, beta=0, alpha=scale[slot])
        i += n
    # A scatter with runs of consecutive rows: as fast as a dense add here, and it writes
    # no row without an adapter.
    y[:, out_offset : out_offset + b_stack.shape[1]].index_add_(0, order, d.to(y.dtype))


def lora_one_hot(
    y: torch.Tensor,  # [T, out_total], updated in place
    x: torch.Tensor,  # [T, in]
    a_stack: torch.Tensor,  # [S, R, in]
    b_stack: torch.Tensor,  # [S, out, R]
    scales: torch.Tensor,  # [S] float32
    active: torch.Tensor,  # [U] int64: the distinct slots in the batch
    one_hot: torch.Tensor,  # [T, U] float32: token t uses active[u]; zero row = no adapter
    *,
    out_offset: int = 0,
    compute_dtype: torch.dtype = torch.float32,
) -> None:
    """All active adapters as one LoRA of rank U*R, masked per token (option d).

    Two dense matmuls whatever the mix, at U times the FLOPs of one adapter. Rows without
    an adapter get ``+= 0``.
    """
    num_active, rank = active.shape[0], a_stack.shape[1]
    a = a_stack.index_select(0, active).to(compute_dtype).view(num_active * rank, -1)
    h = F.linear(x.to(compute_dtype), a).view(-1, num_active, rank)  # [T, U, R]
    h *= (one_hot * scales.index_select(0, active)).to(compute_dtype)[:, :, None]
    b = b_stack.transpose(0, 1)[:, active].to(compute_dtype)  # [out, U, R], one gather
    b = b.view(b_stack.shape[1], num_active * rank)
    yc = y[:, out_offset : out_offset + b_stack.shape[1]]
    if y.dtype == compute_dtype:
        yc.addmm_(h.view(h.shape[0], -1), b.T)
    else:
        yc.add_(F.linear(h.view(h.shape[0], -1), b))
