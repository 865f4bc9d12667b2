"""Multi-LoRA for one projection of a mixed batch: ``add_lora`` picks the kernel per device.

On CUDA tensors: Punica's Triton kernels (``switchboard_kernels/lora_triton.py``), BGMV for an
all-decode step and SGMV otherwise (as vLLM does). The Triton module is imported lazily,
on the first CUDA call, so a CPU process never imports triton, and a test that wants the
kernels in Triton's CPU interpreter can set ``TRITON_INTERPRET=1`` before it imports them.

On CPU with bf16 or fp32 stacks: the native kernel (``switchboard_kernels/lora_cpu.c`` via
``switchboard_kernels/lora_native.py``) for every token, one call per projection group, over each
slot's weights cut to rank and laid out for it (``NativeSlots``, kept beside the stacks by
the LoRA manager; the mapping then carries ``NativeGroups``). Where it cannot be built, or
for fp16 stacks, two torch paths of ``switchboard_kernels/lora_torch.py``: a matmul pair per
long run of one adapter (prefill chunks; a decode batch on one adapter), and, for the rest,
BGMV as padded batched matmuls over the slot stacks themselves (``lora_bucketed``), chosen
from the measurements in ``bench/lora_ops.py``. With bf16/fp16 stacks the pairs use each
slot's A and B cut to its rank, in fp32 and prepacked for oneDNN (``SlotPairs``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from switchboard_kernels import lora_torch
from switchboard_kernels.lora_dora import DoraScales, dora_slot_rows
from switchboard_kernels.lora_mix import MixRows
from switchboard_kernels.lora_native import NativeGroups, NativeSlots, native_library
from switchboard_kernels.lora_torch import BucketPass, SlotPairs

__all__ = [
    "DoraScales",
    "LoraMapping",
    "MixRows",
    "NativeSlots",
    "SlotPairs",
    "add_lora",
    "add_mix",
    "apply_dora",
    "bucket_passes",
    "lora_expand",
    "lora_shrink",
]

# The native kernel beats the best torch path at every shape measured (the 120 LoRA groups
# of a default-model step: decode with 1 to 32 adapters, prefill), several times over at
# decode (docs/performance.md). So with the kernel at hand, every token takes it.

# The CPU policy, from bench/lora_ops.py on the development machine (AMD Zen 5 with
# AVX512-BF16; rank 16, 576 -> 1536, bf16 model and stacks; the figures are in
# docs/performance.md):
# - runs of up to this many tokens compute in fp32, longer ones in the stacks' dtype. From
#   the stacks, a bf16 matmul pair has over twice the fixed cost of an fp32 one, even with
#   A and B cast on every call; with each slot's pair cut to rank (``SlotPairs``), the fp32
#   copies beat the prepacked bf16 ones up to 16 tokens and lose from 32.
FP32_MAX_RUN = 16
# - runs this long take a matmul pair each (no gather, no padding); shorter ones are
#   bucketed by slot (32-token runs cost over twice as much as pairs as bucketed; a single
#   1,024-token run costs under half as much as a pair as bucketed).
SEGMENT_MIN_RUN = 64
# - up to this many short runs, a pair per run beats bucketing (a bucketing pass has a fixed
#   cost of its own: at 7 runs of 8 tokens the two were even).
MAX_SHORT_RUNS = 3
# - one bucketing pass pads every slot of the active range to the busiest slot's count;
#   past both of these, passes of the mean count per slot waste less (with zipf-drawn
#   adapters, several passes took half the time of one at 1,024 tokens, twice it at 32).
MAX_PADDING = 4
MAX_PADDED_ROWS = 2048
# On CUDA, a decode step's group takes the fused shrink + expand kernel
# (switchboard_kernels/lora_fused_triton.py): one launch instead of two and no shrink output in
# memory. Chosen for the launches it saves, not yet timed against the pair on a GPU:
# bench/gpu_check.sh times both (bench.lora_triton), and this switch is where the measurement lands.
FUSED_DECODE = True
# The fused kernel keeps the whole rank of a group in registers as one block: up to this.
FUSED_MAX_RANK = 256
# A pass whose slots all hold ``width`` tokens (``BucketPass.dense``) skips the zero padding
# and both scatters: faster for a 32-adapter decode step, no change at 8 adapters.


Run = tuple[int, int, int]  # (start, end, slot): tokens [start, end) on one adapter slot


@dataclass(slots=True)
class CpuLoraPlan:
    """Host-side views of a LoraMapping for the torch paths."""

    segments: list[Run]  # a matmul pair each, in the stacks' dtype (or prepacked pairs)
    fp32_segments: list[Run]  # runs of at most FP32_MAX_RUN tokens: a pair in fp32
    passes: list[BucketPass]  # every other token with an adapter
    native: NativeGroups | None = None  # all tokens with an adapter (and nothing above)


def bucket_passes(
    rows: Sequence[int], row_slots: Sequence[int], *, width: int | None = None
) -> list[BucketPass]:
    """Cells for ``lora_bucketed``: token ``rows[i]`` (slot ``row_slots[i]``) sits at ordinal
    k among its slot's tokens, in pass ``k // width`` at cell ``(slot - lo) * width + k % width``.

    ``width`` is the busiest slot's count (one pass) unless the padded batch would exceed
    both ``MAX_PADDING`` times the tokens and ``MAX_PADDED_ROWS``; then the mean count per
    slot, and busy slots take several passes. A given ``width`` overrides the choice.
    """
    by_slot: dict[int, list[int]] = {}
    for row, slot in zip(rows, row_slots, strict=True):
        by_slot.setdefault(slot, []).append(row)
    if not by_slot:
        return []
    span = max(by_slot) - min(by_slot) + 1
    busiest = max(len(r) for r in by_slot.values())
    if width is None:
        width = busiest
        if span * busiest > max(MAX_PADDING * len(rows), MAX_PADDED_ROWS):
            width = math.ceil(len(rows) / len(by_slot))
    passes = []
    for first in range(0, busiest, width):
        members = {s: r[first : first + width] for s, r in by_slot.items() if len(r) > first}
        lo, hi = min(members), max(members)
        pass_rows = [row for r in members.values() for row in r]
        cells = [(s - lo) * width + k for s, r in members.items() for k in range(len(r))]
        dense = len(cells) == (hi - lo + 1) * width
        if dense:  # cells are a permutation of the batch: put the rows in cell order
            pass_rows = [row for _, row in sorted(zip(cells, pass_rows, strict=True))]
            cells = list(range(len(cells)))
        passes.append(
            BucketPass(
                lo=lo,
                hi=hi,
                width=width,
                rows=torch.tensor(pass_rows, dtype=torch.int64),
                cells=torch.tensor(cells, dtype=torch.int64),
                dense=dense,
            )
        )
    return passes


@dataclass(slots=True)
class LoraMapping:
    """Which adapter slot each token of a step uses, in every form the LoRA ops need.

    Built once per step with ``LoraMapping.build`` and shared by every layer and projection.
    """

    token_slots: torch.Tensor  # [T] int64 on the model's device; -1 = base model only
    seg_starts: torch.Tensor  # [num_segments + 1] int64: runs of one slot, in token order
    seg_slots: torch.Tensor  # [num_segments] int64, -1 allowed
    max_seg_len: int  # longest run: sizes the SGMV launch grid without a device sync
    any_lora: bool  # False: add_lora returns at once
    all_decode: bool  # one token per sequence: BGMV on GPU
    cpu: CpuLoraPlan | None  # None on GPU
    # Each slot's token rows, for the split ops on CPU (``lora_shrink``/``lora_expand``);
    # made on their first call and shared by every layer after it.
    slot_rows: list[tuple[int, torch.Tensor]] | None = None

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @classmethod
    def build(
        cls,
        token_slots: Sequence[int] | torch.Tensor,
        *,
        device: torch.device | str = "cpu",
        all_decode: bool = False,
        native: bool = False,
    ) -> LoraMapping:
        """From each token's slot (-1 = none), in the flattened batch order of the forward pass.

        ``all_decode``: every token is the single new token of its own sequence.
        ``native``: plan for the native CPU kernel (the stacks keep ``NativeSlots``).
        """
        slots = torch.as_tensor(token_slots, dtype=torch.int64, device="cpu").reshape(-1)
        run_slots, run_lens = torch.unique_consecutive(slots, return_counts=True)
        seg_starts = torch.zeros(run_slots.shape[0] + 1, dtype=torch.int64)
        torch.cumsum(run_lens, 0, out=seg_starts[1:])
        device = torch.device(device)
        return cls(
            token_slots=slots.to(device),
            seg_starts=seg_starts.to(device),
            seg_slots=run_slots.to(device),
            max_seg_len=int(run_lens.max()) if run_lens.numel() else 0,
            any_lora=bool((slots >= 0).any()),
            all_decode=all_decode,
            cpu=_cpu_plan(seg_starts.tolist(), run_slots.tolist(), native=native)
            if device.type == "cpu"
            else None,
        )


def _cpu_plan(bounds: list[int], run_slots: list[int], *, native: bool) -> CpuLoraPlan:
    runs = [(bounds[k], bounds[k + 1], s) for k, s in enumerate(run_slots) if s >= 0]
    if native:
        return CpuLoraPlan([], [], [], native=NativeGroups.from_runs(runs))
    segments = [r for r in runs if r[1] - r[0] >= SEGMENT_MIN_RUN]
    short = [r for r in runs if r[1] - r[0] < SEGMENT_MIN_RUN]
    if len(short) <= MAX_SHORT_RUNS:
        fp32 = [r for r in short if r[1] - r[0] <= FP32_MAX_RUN]
        segments += [r for r in short if r[1] - r[0] > FP32_MAX_RUN]
        return CpuLoraPlan(segments=segments, fp32_segments=fp32, passes=[])
    rows = [row for start, end, _ in short for row in range(start, end)]
    row_slots = [slot for start, end, slot in short for _ in range(start, end)]
    return CpuLoraPlan(segments, fp32_segments=[], passes=bucket_passes(rows, row_slots))


def add_lora(
    y: torch.Tensor,  # [T, out_total], updated in place
    x: torch.Tensor,  # [T, in], the projection's input
    a_stack: torch.Tensor,  # [S, R, in]
    b_stack: torch.Tensor,  # [S, out, R]
    scales: torch.Tensor,  # [S] float32
    mapping: LoraMapping,
    *,
    out_offset: int = 0,
    pairs: SlotPairs | None = None,
    native: NativeSlots | None = None,
    dora: DoraScales | None = None,
    dora_base: torch.Tensor | None = None,
    mix: MixRows | None = None,
) -> None:
    """Semantics: ``y[t, o:o+out] += scales[s] * x[t] @ a_stack[s].T @ b_stack[s].T``, s=s_t>=0;
    then, with ``dora``, ``apply_dora`` on the rows of DoRA slots; then, with ``mix``, each
    mixed token t (``s_t = -1`` in ``mapping``) gets ``sum_k w_k * scales[s_k] * x[t] @
    a_stack[s_k].T @ b_stack[s_k].T`` over its parts (``switchboard_kernels/lora_mix.py``).

    ``pairs``: the stacks' slots cut to rank (CPU only; must match the stacks' contents).
    ``native``: the same for the native kernel; required by a mapping built ``native``.
    ``dora_base``: the part of y DoRA leaves alone (see ``apply_dora``).
    """
    if mapping.any_lora:
        _add_lora(y, x, a_stack, b_stack, scales, mapping, out_offset, pairs, native)
        if dora is not None:
            if out_offset != 0:
                raise ValueError("DoRA rescales a whole group's output (out_offset 0)")
            apply_dora(y, dora, mapping, base=dora_base)
    if mix is not None:
        add_mix(
            y, x, a_stack, b_stack, scales, mix, out_offset=out_offset, pairs=pairs, native=native
        )


def add_mix(
    y: torch.Tensor,  # [T, out_total], updated in place
    x: torch.Tensor,  # [T, in]
    a_stack: torch.Tensor,  # [S, R, in]
    b_stack: torch.Tensor,  # [S, out, R]
    scales: torch.Tensor,  # [S] float32
    mix: MixRows,
    *,
    out_offset: int = 0,
    pairs: SlotPairs | None = None,
    native: NativeSlots | None = None,
) -> None:
    """Semantics: ``y[t, o:o+out] += sum_k w_k * scales[s_k] * x[t] @ a_stack[s_k].T @
    b_stack[s_k].T`` for each mixed token t and its parts (s_k, w_k).

    Native: a call per part index over virtual slots. Otherwise the parts run as virtual rows
    (weighted inputs) through the same kernels as any batch, into a scratch output added into
    y part by part (``switchboard_kernels/lora_mix.py``)."""
    if mix.native is not None:
        library = native_library()
        if native is None or library is None:
            raise ValueError("a mix built for the native kernel needs NativeSlots")
        for part in mix.native:
            table, part_scales = native.virtual(part.key, part.sources, part.weights, scales)
            library.bgmv(y, x, native, part_scales, part.groups, out_offset, table=table)
        return
    assert mix.mapping is not None
    out = b_stack.shape[1]
    deltas = y.new_zeros(mix.num_rows, out)  # [V, out]
    _add_lora(deltas, mix.inputs(x), a_stack, b_stack, scales, mix.mapping, 0, pairs, native)
    mix.add(y[:, out_offset : out_offset + out], deltas)


def apply_dora(
    y: torch.Tensor,  # [T, >= out], the group's output with the LoRA delta in, updated in place
    dora: DoraScales,
    mapping: LoraMapping,
    *,
    base: torch.Tensor | None = None,  # [out] (a bias) or [T, out] (a residual), y's dtype
) -> None:
    """Semantics: ``y[t, :out] = z_t + dora.scales[s_t] ⊙ (y[t, :out] - z_t)`` for every row
    whose slot s_t holds a DoRA adapter (z = base, or 0); other rows untouched.

    CUDA: a Triton kernel over the rows; CPU: the native kernel over the mapping's groups, or
    a gather and scatter per DoRA slot in torch (``switchboard_kernels/lora_dora.py``).
    """
    if mapping.cpu is None:
        from switchboard_kernels import lora_triton as tri  # first CUDA call only

        tri.dora_rescale(y, dora.scales, dora.enabled, mapping.token_slots, base=base)
    elif mapping.cpu.native is not None:
        library = native_library()
        if library is None:
            raise ValueError("a mapping built for the native kernel needs the native library")
        library.dora(y, dora, mapping.cpu.native, base)
    else:
        dora_slot_rows(y, dora, _slot_rows(mapping), base)


def _add_lora(
    y, x, a_stack, b_stack, scales, mapping: LoraMapping, out_offset: int, pairs, native
) -> None:
    if mapping.cpu is None:
        _add_lora_triton(y, x, a_stack, b_stack, scales, mapping, out_offset)
    elif mapping.cpu.native is not None:
        library = native_library()
        if native is None or library is None:
            raise ValueError("a mapping built for the native kernel needs NativeSlots")
        library.bgmv(y, x, native, scales, mapping.cpu.native, out_offset)
    else:
        _add_lora_cpu(y, x, a_stack, b_stack, scales, mapping.cpu, out_offset, pairs)


def _add_lora_triton(y, x, a_stack, b_stack, scales, mapping: LoraMapping, out_offset: int) -> None:
    from switchboard_kernels import (
        lora_triton as tri,  # first CUDA call only; see the module docstring
    )

    m = mapping
    if m.all_decode and FUSED_DECODE and a_stack.shape[1] <= FUSED_MAX_RANK:
        from switchboard_kernels.lora_fused_triton import bgmv_fused

        bgmv_fused(y, x, a_stack, b_stack, m.token_slots, scales, out_offset=out_offset)
    elif m.all_decode:
        h = tri.bgmv_shrink(x, a_stack, m.token_slots)
        tri.bgmv_expand(y, h, b_stack, m.token_slots, scales, out_offset=out_offset)
    else:
        seg, longest = (m.seg_starts, m.seg_slots), m.max_seg_len
        h = tri.sgmv_shrink(x, a_stack, *seg, max_seg_len=longest)
        tri.sgmv_expand(y, h, b_stack, *seg, scales, out_offset=out_offset, max_seg_len=longest)


def _add_lora_cpu(
    y, x, a_stack, b_stack, scales, plan: CpuLoraPlan, out_offset: int, pairs: SlotPairs | None
) -> None:
    """The plan's runs as a matmul pair each, the rest bucketed (thresholds above).

    Long runs and buckets compute in the stacks' dtype (the model's), so no weight is cast
    on the hot path; with AVX512-BF16 a bf16 matmul beats fp32 past a handful of tokens.
    With ``pairs`` every run uses its slot's pair cut to rank instead: the fp32 copy for
    a short run, the prepacked one past that.
    """
    args = (y, x, a_stack, b_stack, scales)
    for runs, fp32 in ((plan.segments, False), (plan.fp32_segments, True)):
        if not runs:
            continue
        if pairs is not None:
            lora_torch.lora_packed_segments(y, x, pairs, scales, runs, out_offset, fp32=fp32)
        else:
            dtype = torch.float32 if fp32 else a_stack.dtype
            lora_torch.lora_segments(*args, runs, out_offset=out_offset, compute_dtype=dtype)
    if plan.passes:
        lora_torch.lora_bucketed(*args, plan.passes, out_offset=out_offset)


# --- shrink and expand apart (tensor parallelism: S-LoRA's exchange goes between them) ----


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    a_stack: torch.Tensor,  # [S, R, in]
    mapping: LoraMapping,
) -> torch.Tensor:  # [T, R], x's dtype
    """Semantics: ``out[t] = x[t] @ a_stack[s_t].T`` if ``s_t >= 0`` else 0 (``bgmv_shrink``).

    CUDA: Punica's Triton shrink (BGMV for an all-decode step, SGMV otherwise). CPU: one
    matmul per slot of the step over its tokens gathered, in the stacks' dtype."""
    if mapping.cpu is None:
        from switchboard_kernels import lora_triton as tri  # first CUDA call only

        if mapping.all_decode:
            return tri.bgmv_shrink(x, a_stack, mapping.token_slots)
        return tri.sgmv_shrink(
            x, a_stack, mapping.seg_starts, mapping.seg_slots, max_seg_len=mapping.max_seg_len
        )
    out = x.new_zeros(x.shape[0], a_stack.shape[1])
    for slot, rows in _slot_rows(mapping):
        out.index_copy_(0, rows, x.index_select(0, rows) @ a_stack[slot].T)
    return out


def lora_expand(
    y: torch.Tensor,  # [T, out_total], updated in place
    h: torch.Tensor,  # [T, R], the shrink output
    b_stack: torch.Tensor,  # [S, out, R]
    scales: torch.Tensor,  # [S] float32
    mapping: LoraMapping,
    *,
    out_offset: int = 0,
) -> None:
    """Semantics: ``y[t, o:o+out] += scales[s_t] * h[t] @ b_stack[s_t].T`` for ``s_t >= 0``
    (``bgmv_expand``). Kernels as ``lora_shrink``'s."""
    if mapping.cpu is None:
        from switchboard_kernels import lora_triton as tri  # first CUDA call only

        if mapping.all_decode:
            tri.bgmv_expand(y, h, b_stack, mapping.token_slots, scales, out_offset=out_offset)
        else:
            seg = (mapping.seg_starts, mapping.seg_slots)
            tri.sgmv_expand(
                y, h, b_stack, *seg, scales, out_offset=out_offset, max_seg_len=mapping.max_seg_len
            )
        return
    cols = y[:, out_offset : out_offset + b_stack.shape[1]]
    for slot, rows in _slot_rows(mapping):
        delta = h.index_select(0, rows) @ b_stack[slot].T
        cols.index_add_(0, rows, delta, alpha=float(scales[slot]))


def _slot_rows(mapping: LoraMapping) -> list[tuple[int, torch.Tensor]]:
    """(slot, its token rows) for each slot the step uses, made once per mapping."""
    if mapping.slot_rows is None:
        slots = mapping.token_slots
        mapping.slot_rows = [
            (slot, (slots == slot).nonzero().squeeze(1))
            for slot in sorted(set(slots.tolist()) - {-1})
        ]
    return mapping.slot_rows
