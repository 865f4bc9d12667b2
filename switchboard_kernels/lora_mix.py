"""Weighted adapter mixes in the batched LoRA path: a row that asks for several adapters gets
``sum_k w_k * delta_k(x)``, each adapter's delta read from its own slot, never merged.

A mixed token becomes one *virtual row* per part: the part's slot, and the token's input
scaled by the part's weight (a LoRA delta is linear in its input, so ``delta_s(w x) = w
delta_s(x)``). The virtual rows run through ``add_lora`` like any batch (the native C kernel,
the torch paths or Triton, whichever the device takes), into a scratch output that is then
added into the mixed tokens' rows, one part at a time. Single-adapter and base rows never
see any of this: they keep the step's own mapping, unchanged, and its kernels' speed.

Ranks may differ between the parts (each slot is cut to its own rank as usual). Parts are
plain LoRA (rsLoRA and rank/alpha patterns included): DoRA's rescale and saved modules are
per adapter, not per delta, so a mix of them is refused before it gets here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from switchboard_kernels.lora import LoraMapping

# (start, end, parts): tokens [start, end) all use the weighted slots ``parts``, (slot, weight).
MixRun = tuple[int, int, Sequence[tuple[int, float]]]


@dataclass(slots=True)
class MixRows:
    """A step's mixed tokens as virtual rows, built once per step and shared by every layer.

    Virtual rows are laid out run by run, part by part (each part of a run is one contiguous
    segment of one slot, which SGMV and the CPU plans take whole)."""

    rows: torch.Tensor  # [V] int64 on the device: the token each virtual row reads and adds to
    weights: torch.Tensor  # [V, 1] float32 on the device: its part's weight
    # Per part index k: (positions among the virtual rows, their tokens); a token appears at
    # most once in each, so every index_add_ has distinct targets (deterministic on CUDA too).
    parts: list[tuple[torch.Tensor, torch.Tensor]]
    mapping: LoraMapping  # over the V virtual rows

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]

    @classmethod
    def build(
        cls,
        runs: Sequence[MixRun],
        *,
        device: torch.device | str = "cpu",
        all_decode: bool = False,
        native: bool = False,
    ) -> MixRows | None:
        """From the step's runs of mixed tokens; None when there are none."""
        from switchboard_kernels.lora import LoraMapping  # lora imports this module

        rows: list[int] = []
        slots: list[int] = []
        weights: list[float] = []
        by_part: dict[int, tuple[list[int], list[int]]] = {}
        for start, end, parts in runs:
            for k, (slot, weight) in enumerate(parts):
                positions, tokens = by_part.setdefault(k, ([], []))
                positions.extend(range(len(rows), len(rows) + end - start))
                tokens.extend(range(start, end))
                rows.extend(range(start, end))
                slots.extend([slot] * (end - start))
                weights.extend([weight] * (end - start))
        if not rows:
            return None
        device = torch.device(device)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device)

        return cls(
            rows=ints(rows),
            weights=torch.tensor(weights, dtype=torch.float32).reshape(-1, 1).to(device),
            parts=[(ints(p), ints(t)) for p, t in by_part.values()],
            mapping=LoraMapping.build(slots, device=device, all_decode=all_decode, native=native),
        )

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """``[V, in]``: each virtual row's token input times its weight (in fp32, rounded once
        to x's dtype)."""
        picked = x.index_select(0, self.rows)
        if picked.dtype == torch.float32:
            return picked.mul_(self.weights)
        return (picked.float() * self.weights).to(x.dtype)

    def add(self, cols: torch.Tensor, deltas: torch.Tensor) -> None:
        """``cols[token] += deltas[v]`` for every virtual row, one part at a time."""
        for positions, tokens in self.parts:
            cols.index_add_(0, tokens, deltas.index_select(0, positions))
