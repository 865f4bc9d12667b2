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
The three ``lora_*`` functions below them are the fused (shrink + expand) CPU paths that
``bench/lora_ops.py`` measures and ``switchboard_kernels/lora.py`` dispatches to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from switchboard_kernels.linear import Linear, can_pack


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


# --- fused CPU paths: y[:, o:o+out] += scale * (x @ A.T) @ B.T ---------------------------
# Each takes the host-side batch description that LoraMapping prepares once per step (no
# device sync, no Python loop over tokens).


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
    """SGMV in torch: two matmuls per run of tokens, no gather."""
    yc = y[:, out_offset : out_offset + b_stack.shape[1]]
    scale = scales.tolist()
    for i, j, slot in segments:
        # Cast the run's rows only: a few short runs beside a long prefill chunk would
        # otherwise copy the whole batch on every call.
        h = F.linear(x[i:j].to(compute_dtype), a_stack[slot].to(compute_dtype))  # [j - i, R]
        b = b_stack[slot].to(compute_dtype)
        if y.dtype == compute_dtype:  # accumulate straight into y, no [n, out] temporary
            yc[i:j].addmm_(h, b.T, alpha=scale[slot])
        else:
            yc[i:j].add_(F.linear(h, b), alpha=scale[slot])


@dataclass(slots=True)
class SlotPair:
    """One slot's A and B cut to the rank it really holds, in two forms."""

    a: Linear  # [r, in], prepacked for oneDNN
    b: Linear  # [out, r], prepacked
    a32: torch.Tensor  # [r, in] fp32: runs of a few tokens (no cast per call)
    b32: torch.Tensor  # [out, r] fp32


class SlotPairs:
    """Each slot's A and B of one stack, for runs of one adapter on CPU (bf16/fp16 stacks).

    A run is two tiny matmuls, whose cost is mostly fixed per call: oneDNN reorders an
    unpacked bf16 weight on every call, and an fp32 one must be cast first. So each slot
    is cut to its adapter's real rank (the stacks pad every slot to ``max_lora_rank``; the
    rows and columns dropped are zero, so the result is exact), then kept prepacked in the
    stacks' dtype and as fp32: in a default-model decode step, packed pairs take half the
    time of plain bf16 ones at 32 tokens, and fp32 copies beat both packed and cast-per-call
    at 1 token (docs/performance.md). A slot whose adapter leaves this stack's modules alone
    has no pair and costs nothing. Memory: three
    times the adapter's real rank in bf16 bytes, beside the padded stacks.
    """

    __slots__ = ("dtype", "pairs")

    def __init__(self, num_slots: int, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.pairs: list[SlotPair | None] = [None] * num_slots

    @staticmethod
    def wanted(a_stack: torch.Tensor) -> bool:
        """Only where packing pays: fp32 stacks keep ``lora_segments``'s fp32 arithmetic."""
        return a_stack.dtype != torch.float32 and can_pack(a_stack)

    def refresh(self, slot: int, a_stack: torch.Tensor, b_stack: torch.Tensor) -> None:
        """Rebuild ``slot``'s pair after its rows of the stacks changed."""
        keep = a_stack[slot].ne(0).any(dim=1).nonzero().squeeze(1)  # rank rows in use
        if keep.numel() == 0:
            self.pairs[slot] = None
            return
        a, b = a_stack[slot].index_select(0, keep), b_stack[slot].index_select(1, keep)
        self.pairs[slot] = SlotPair(Linear(a), Linear(b), a.float(), b.float())


def lora_packed_segments(
    y: torch.Tensor,  # [T, out_total], updated in place
    x: torch.Tensor,  # [T, in]
    pairs: SlotPairs,  # the stacks' slots, cut to rank
    scales: torch.Tensor,  # [S] float32
    segments: list[tuple[int, int, int]],  # (start, end, slot >= 0): runs of one adapter
    out_offset: int = 0,
    *,
    fp32: bool = False,
) -> None:
    """SGMV in torch over ``SlotPairs``: two matmuls per run, with the prepacked pair, or
    the fp32 one (``fp32``: for runs of a few tokens)."""
    scale = scales.tolist()
    for i, j, slot in segments:
        pair = pairs.pairs[slot]
        if pair is None:  # the adapter has no weights in this stack's modules
            continue
        out_features = pair.b32.shape[0]
        yc = y[i:j, out_offset : out_offset + out_features]
        if fp32:
            h = F.linear(x[i:j].float(), pair.a32)  # the run's rows only, as lora_segments
            yc.add_(F.linear(h, pair.b32), alpha=scale[slot])
        else:
            h = pair.a(x[i:j].to(pairs.dtype))
            if scale[slot] != 1.0:
                h *= scale[slot]
            yc.add_(pair.b(h))


@dataclass(slots=True)
class BucketPass:
    """One padded batch for ``lora_bucketed``: slots ``lo..hi``, ``width`` cells each."""

    lo: int
    hi: int
    width: int
    rows: torch.Tensor  # [n] int64: the tokens of this pass
    cells: torch.Tensor  # [n] int64: (slot - lo) * width + ordinal within the slot
    # Every cell holds a token (n == slots * width) and ``rows`` is in cell order: the
    # batch is x's rows in that order, without padding or scatter (a decode step of
    # distinct adapters, or of adapters with equal counts).
    dense: bool = False


def lora_bucketed(
    y: torch.Tensor,  # [T, out_total], updated in place
    x: torch.Tensor,  # [T, in]
    a_stack: torch.Tensor,  # [S, R, in]
    b_stack: torch.Tensor,  # [S, out, R]
    scales: torch.Tensor,  # [S] float32
    passes: list[BucketPass],
    *,
    out_offset: int = 0,
) -> None:
    """BGMV in torch: tokens bucketed by slot into a zero-padded [slots, width, in] batch,
    then two batched matmuls straight over the slot range of the stacks (a view, no copy).

    Copying A and B once per token (the textbook BGMV in torch) moves several times the
    adapter bytes; this reads each slot in the range once, at the price of padded rows,
    which ``switchboard_kernels.lora.bucket_passes`` bounds. Computes in the stacks' dtype.
    """
    dtype, out_features = a_stack.dtype, b_stack.shape[1]
    yc = y[:, out_offset : out_offset + out_features]
    for p in passes:
        count = p.hi - p.lo + 1
        if p.dense:
            batch = x.index_select(0, p.rows).to(dtype)
        else:
            batch = x.new_zeros((count * p.width, x.shape[1]), dtype=dtype)
            batch.index_copy_(0, p.cells, x.index_select(0, p.rows).to(dtype))
        slots = slice(p.lo, p.hi + 1)
        h = torch.bmm(batch.view(count, p.width, -1), a_stack[slots].transpose(1, 2))
        h *= scales[slots].to(dtype)[:, None, None]
        d = torch.bmm(h, b_stack[slots].transpose(1, 2)).view(count * p.width, out_features)
        yc.index_add_(0, p.rows, (d if p.dense else d.index_select(0, p.cells)).to(y.dtype))
