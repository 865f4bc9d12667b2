"""Multi-LoRA for one projection of a mixed batch: ``add_lora`` picks the kernel per device.

On CUDA tensors: Punica's Triton kernels (``kernels/lora_triton.py``), BGMV for an
all-decode step and SGMV otherwise (as vLLM does). The Triton module is imported lazily,
on the first CUDA call, so a CPU process never imports triton, and a test that wants the
kernels in Triton's CPU interpreter can set ``TRITON_INTERPRET=1`` before it imports them.

On CPU: the fused torch paths of ``kernels/lora_reference.py``, chosen per batch shape from
the measurements in ``bench/lora_ops.py`` (see ``_add_lora_cpu``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import lora_reference as ref

# CPU policy thresholds, measured with bench/lora_ops.py (one thread, rank 16, 576 -> 1536,
# ms per call; LoRA paths computing in fp32 unless marked bf16):
# - bf16 activations with at most this many tokens compute the LoRA in fp32: a tiny bf16
#   matmul pays ~25 us of fixed oneDNN cost, fp32 ~5 us. One adapter: T=1 0.038 vs 0.087
#   bf16, T=8 0.048 vs 0.104, T=32 even (0.124 vs 0.119), T=64 0.225 vs 0.117 bf16.
FP32_MAX_TOKENS = 32
# - Several adapters in bf16 take the one-hot path, which converts every active adapter to
#   bf16 on each call when the stacks are fp32; that pays only past this many tokens (fp32
#   stacks, 8 adapters, grouped fp32 vs one-hot bf16: T=128 0.57 vs 0.77, T=256 0.79 vs
#   0.87, T=1024 2.59 vs 1.52). With bf16 stacks it wins from T=64 (T=256 0.71 vs 0.94).
ONE_HOT_MIN_TOKENS_FP32_STACKS = 256
# - Runs at least this long on average make a matmul pair per run beat gathering by adapter
#   (fp32, 8 adapters: T=1024 in 32-token runs 1.57 vs 1.89; T=256 in 8-token runs 0.96 vs
#   0.74 grouped).
SEGMENTS_MIN_AVG_RUN = 16


@dataclass(slots=True)
class CpuLoraPlan:
    """Host-side views of a LoraMapping for the torch paths: Python lists and index tensors."""

    segments: list[tuple[int, int, int]]  # (start, end, slot) of runs with slot >= 0
    groups: list[tuple[int, int]]  # (slot, count) per distinct slot, ascending
    order: torch.Tensor  # [N] int64: tokens with an adapter, grouped as in `groups`
    rows: torch.Tensor  # [N] int64: tokens with an adapter, ascending
    row_slots: torch.Tensor  # [N] int64: their slots
    active: torch.Tensor  # [U] int64: the distinct slots
    one_hot: torch.Tensor  # [T, U] float32: 1 where token t uses active[u]


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
    ) -> LoraMapping:
        """From each token's slot (-1 = none), in the flattened batch order of the forward pass.

        ``all_decode``: every token is the single new token of its own sequence.
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
            cpu=_cpu_plan(slots, seg_starts.tolist(), run_slots.tolist())
            if device.type == "cpu"
            else None,
        )


def _cpu_plan(slots: torch.Tensor, bounds: list[int], run_slots: list[int]) -> CpuLoraPlan:
    rows = (slots >= 0).nonzero().squeeze(1)
    row_slots = slots[rows]
    sorted_slots, perm = torch.sort(row_slots, stable=True)
    active, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    return CpuLoraPlan(
        segments=[(bounds[k], bounds[k + 1], s) for k, s in enumerate(run_slots) if s >= 0],
        groups=list(zip(active.tolist(), counts.tolist(), strict=True)),
        order=rows[perm],
        rows=rows,
        row_slots=row_slots,
        active=active,
        one_hot=(slots[:, None] == active[None, :]).float(),
    )


def add_lora(
    y: torch.Tensor,  # [T, out_total], updated in place
    x: torch.Tensor,  # [T, in], the projection's input
    a_stack: torch.Tensor,  # [S, R, in]
    b_stack: torch.Tensor,  # [S, out, R]
    scales: torch.Tensor,  # [S] float32
    mapping: LoraMapping,
    *,
    out_offset: int = 0,
) -> None:
    """Semantics: ``y[t, o:o+out] += scales[s] * x[t] @ a_stack[s].T @ b_stack[s].T``, s=s_t>=0."""
    if not mapping.any_lora:
        return
    if mapping.cpu is None:
        _add_lora_triton(y, x, a_stack, b_stack, scales, mapping, out_offset)
    else:
        _add_lora_cpu(y, x, a_stack, b_stack, scales, mapping.cpu, out_offset)


def _add_lora_triton(y, x, a_stack, b_stack, scales, mapping: LoraMapping, out_offset: int) -> None:
    from kernels import lora_triton as tri  # first CUDA call only; see the module docstring

    m = mapping
    if m.all_decode:
        h = tri.bgmv_shrink(x, a_stack, m.token_slots)
        tri.bgmv_expand(y, h, b_stack, m.token_slots, scales, out_offset=out_offset)
    else:
        seg, longest = (m.seg_starts, m.seg_slots), m.max_seg_len
        h = tri.sgmv_shrink(x, a_stack, *seg, max_seg_len=longest)
        tri.sgmv_expand(y, h, b_stack, *seg, scales, out_offset=out_offset, max_seg_len=longest)


def _add_lora_cpu(y, x, a_stack, b_stack, scales, plan: CpuLoraPlan, out_offset: int) -> None:
    """The fastest measured torch path for this batch shape (thresholds above)."""
    num_tokens, num_runs, num_groups = x.shape[0], len(plan.segments), len(plan.groups)
    # Nearly one token per adapter (decode with many adapters): per-token copies of A and B
    # cost no more than reading each adapter once, in two batched matmuls (bf16 stacks, T=8,
    # 7-8 adapters in as many runs: 0.24-0.28 vs 0.29-0.31 for a matmul pair per run).
    mostly_distinct = 4 * num_groups > 3 * plan.rows.shape[0]
    bf16 = x.dtype == torch.bfloat16 and num_tokens > FP32_MAX_TOKENS
    args = (y, x, a_stack, b_stack, scales)
    kw = {"out_offset": out_offset, "compute_dtype": x.dtype if bf16 else torch.float32}
    if num_runs == 1 or (num_runs <= num_groups and not mostly_distinct):
        # Each adapter's tokens are contiguous already (one adapter; prefill by adapter): a
        # matmul pair per run, no gather.
        ref.lora_segments(*args, plan.segments, **kw)
    elif bf16 and (a_stack.dtype != torch.float32 or num_tokens > ONE_HOT_MIN_TOKENS_FP32_STACKS):
        # One wide bf16 matmul pair instead of a pair per adapter, each paying oneDNN's fixed
        # cost (bf16 stacks, T=1024, 8 adapters: 1.43 vs 2.67 for grouped in fp32).
        ref.lora_one_hot(*args, plan.active, plan.one_hot, **kw)
    else:
        kw["compute_dtype"] = torch.float32
        if mostly_distinct:
            ref.lora_gathered(*args, plan.rows, plan.row_slots, **kw)
        elif num_tokens >= SEGMENTS_MIN_AVG_RUN * num_runs:
            ref.lora_segments(*args, plan.segments, **kw)
        else:
            # Several tokens per adapter: gather them by adapter, one matmul pair per adapter.
            ref.lora_grouped(*args, plan.order, plan.groups, **kw)
