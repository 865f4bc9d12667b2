"""Batched multi-LoRA on CPU in torch, shrink and expand fused: for each projection,
``y[:, o:o+out] += scale * (x @ A.T) @ B.T`` over a step's mixed adapters. Each takes the
host-side batch description that ``LoraMapping`` prepares once per step (no device sync, no
Python loop over tokens); ``switchboard_kernels/lora.py`` picks one per call and
``bench/lora_ops.py`` measures them. The stacks' layout is ``lora_reference.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from switchboard_kernels.linear import Linear, can_pack


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
