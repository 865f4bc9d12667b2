"""DoRA in the batched LoRA path: each slot's per-output-feature factor, applied to its rows.

DoRA (Liu et al., ICML 2024) as PEFT computes it at inference: a projection's output is
``g ⊙ (W x + scale · B A x)`` (plus the base layer's bias, not rescaled), with
``g = magnitude / ‖W + scale · B A‖`` over each output feature's row. ``g`` depends only on
the adapter and the base weight, so the LoRA manager computes it once per adapter and keeps it
beside the slot stacks here; a step adds every row's LoRA delta as for plain LoRA, then
rescales the rows whose slot holds a DoRA adapter (``switchboard_kernels.lora.apply_dora``), so
DoRA rows, plain LoRA rows and rows without an adapter share one step.

``base``: the part of ``y`` that is neither ``W x`` nor the delta and must not be rescaled:
the projection's bias ([out], the same for every row) or a residual added into the same output
([T, out]); the rescale is then ``y = z + g ⊙ (y - z)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class DoraScales:
    """One stack's DoRA factors by slot. A slot without DoRA here holds ones and is off."""

    scales: torch.Tensor  # [S, out] float32 on the stacks' device
    enabled: torch.Tensor  # [S] int64 on the stacks' device: 1 where the slot's adapter is DoRA
    host: list[bool]  # ``enabled`` on the host (no device sync to plan a step)

    @classmethod
    def allocate(cls, num_slots: int, out_features: int, device: torch.device) -> DoraScales:
        return cls(
            scales=torch.ones(num_slots, out_features, dtype=torch.float32, device=device),
            enabled=torch.zeros(num_slots, dtype=torch.int64, device=device),
            host=[False] * num_slots,
        )

    def set(self, slot: int, scale: torch.Tensor | None) -> None:
        """``scale`` [out] for a DoRA adapter in ``slot``, None for any other."""
        self.scales[slot] = 1.0 if scale is None else scale
        self.enabled[slot] = int(scale is not None)
        self.host[slot] = scale is not None

    @property
    def out_features(self) -> int:
        return self.scales.shape[1]


def check_dora(y: torch.Tensor, dora: DoraScales, base: torch.Tensor | None) -> None:
    """The shapes every DoRA path checks before it touches memory."""
    out = dora.out_features
    if y.dim() != 2 or y.shape[1] < out or dora.scales.dtype != torch.float32:
        raise ValueError(f"DoRA: y {tuple(y.shape)} does not fit scales {tuple(dora.scales.shape)}")
    if base is not None and (
        base.dtype != y.dtype
        or base.shape[-1] != out
        or base.dim() not in (1, 2)
        or (base.dim() == 2 and base.shape[0] != y.shape[0])
    ):
        raise ValueError(f"DoRA: base {base.dtype} {tuple(base.shape)} does not fit y {y.dtype}")


def dora_slot_rows(
    y: torch.Tensor,  # [T, >= out], updated in place
    dora: DoraScales,
    slot_rows: list[tuple[int, torch.Tensor]],  # (slot, its rows) for the step's slots
    base: torch.Tensor | None = None,  # [out] or [T, out], y's dtype
) -> None:
    """Semantics: ``y[t, :out] = z_t + scales[s_t] ⊙ (y[t, :out] - z_t)`` for each row t of
    a slot s_t with DoRA (z = base, or 0). The CPU torch path: one gather and scatter per slot."""
    check_dora(y, dora, base)
    out = dora.out_features
    cols = y[:, :out]
    for slot, rows in slot_rows:
        if not dora.host[slot]:
            continue
        v = cols.index_select(0, rows).float()
        g = dora.scales[slot]
        if base is None:
            v *= g
        else:
            z = (base if base.dim() == 1 else base.index_select(0, rows)).float()
            v = torch.addcmul(z, g, v - z)
        cols.index_copy_(0, rows, v.to(y.dtype))
