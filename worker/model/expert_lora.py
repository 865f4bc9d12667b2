"""LoRA on a MoE layer's experts, applied inside the grouped expert path (``worker.model.moe``).

PEFT's ``target_parameters`` adapt the fused expert tensors: expert e's gate_up (down) weight
becomes ``W_e + s · B_e A_e`` (``adapters.peft_experts``). Here each sparse layer keeps, per
expert, every slot's A side by side (Punica's stacked slots, S-LoRA's padding to
``max_lora_rank``): A [E, slots · R, in] and B [E, out, slots · R] with the scaling folded into
B. An expert's rows multiply its A of all slots at once ([rows, slots · R], a few hundred
columns beside the expert's thousands), the columns of slots other than each row's own are
zeroed, and the product with B adds each row's own delta: base rows, rows of adapters without
expert LoRA and rows of different adapters share one step, without per-token loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adapters.lora import LoraWeights


@dataclass(slots=True)
class _Pair:
    a: torch.Tensor  # [experts, slots * max_rank, in_features]
    b: torch.Tensor  # [experts, out_features, slots * max_rank], scaling folded in


@dataclass(slots=True)
class ExpertSlots:
    """One sparse layer's expert LoRA across all slots."""

    gate_up: _Pair  # in: hidden, out: 2 * expert intermediate (gate, then up)
    down: _Pair  # in: expert intermediate, out: hidden
    max_rank: int
    has_delta: torch.Tensor  # [slots] bool: the slot's adapter has expert LoRA here
    used: bool = False  # some adapter ever had expert LoRA here (else skip it)

    @classmethod
    def allocate(
        cls,
        *,
        experts: int,
        slots: int,
        max_rank: int,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> ExpertSlots:
        width = slots * max_rank

        def pair(in_features: int, out_features: int) -> _Pair:
            on = {"dtype": dtype, "device": device}
            return _Pair(
                a=torch.zeros(experts, width, in_features, **on),
                b=torch.zeros(experts, out_features, width, **on),
            )

        return cls(
            pair(hidden, 2 * intermediate),
            pair(intermediate, hidden),
            max_rank,
            torch.zeros(slots, dtype=torch.bool, device=device),
        )

    def fill(self, slot: int, gate_up: LoraWeights | None, down: LoraWeights | None) -> None:
        """Put one adapter's expert LoRA of this layer in ``slot`` (zeros where it has none)."""
        self.has_delta[slot] = gate_up is not None or down is not None
        for pair, w in ((self.gate_up, gate_up), (self.down, down)):
            cols = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
            pair.a[:, cols].zero_()
            pair.b[:, :, cols].zero_()
            if w is None:
                continue
            experts, r = pair.a.shape[0], w.rank
            a = torch.from_numpy(w.a.copy()).view(experts, r, -1)  # expert-major rows
            b = torch.from_numpy(w.b * np.float32(w.scaling))  # [out, r * experts], rank-major
            b = b.view(b.shape[0], r, experts).permute(2, 0, 1)  # [experts, out, r]
            start = slot * self.max_rank
            pair.a[:, start : start + r].copy_(a)
            pair.b[:, :, start : start + r].copy_(b)
            self.used = True


@dataclass(slots=True)
class ExpertLora:
    """A step's expert LoRA for one layer: the slots and each token's slot (-1: none)."""

    slots: ExpertSlots
    token_slots: torch.Tensor  # [tokens] int64

    def rows_with_delta(self) -> torch.Tensor | None:
        """[tokens] bool: the rows whose adapter has expert LoRA in this layer; None if none."""
        slots = self.token_slots
        adapted = (slots >= 0) & self.slots.has_delta[slots.clamp(min=0)]
        return adapted if bool(adapted.any()) else None

    def select(self, rows: torch.Tensor) -> ExpertLora:
        """The same for the step's ``rows`` only (their token indices)."""
        return ExpertLora(self.slots, self.token_slots[rows])

    def for_pairs(self, token: torch.Tensor) -> ExpertLoraStep:
        """For the routed pairs (``token``: each pair's token, grouped by expert)."""
        width = self.slots.gate_up.a.shape[1]
        column_slot = torch.arange(width, device=token.device) // self.slots.max_rank
        own = self.token_slots[token][:, None] == column_slot[None, :]  # [pairs, width]
        return ExpertLoraStep(self.slots, own.to(self.slots.gate_up.a.dtype))


@dataclass(slots=True)
class ExpertLoraStep:
    slots: ExpertSlots
    mask: torch.Tensor  # [pairs, slots * max_rank]: 1 in the columns of each pair's slot

    def add_gate_up(self, y: torch.Tensor, x: torch.Tensor, expert: int, rows: slice) -> None:
        """``y += x A_e^T ⊙ mask B_e^T`` for one expert's rows of the gate/up projection."""
        _add(y, x, self.slots.gate_up, expert, self.mask[rows])

    def add_down(self, y: torch.Tensor, x: torch.Tensor, expert: int, rows: slice) -> None:
        _add(y, x, self.slots.down, expert, self.mask[rows])


def _add(y: torch.Tensor, x: torch.Tensor, pair: _Pair, e: int, mask: torch.Tensor) -> None:
    h = (x @ pair.a[e].T).mul_(mask)  # [rows, slots * max_rank]
    y.addmm_(h, pair.b[e].T)
