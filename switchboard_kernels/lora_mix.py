"""Weighted adapter mixes in the batched LoRA path: a row that asks for several adapters gets
``sum_k w_k * delta_k(x)``, each adapter's delta read from its own slot, never merged.

Single-adapter and base rows never see any of this: they keep the step's own mapping, unchanged,
and its kernels' speed; the mixed tokens are -1 there. Two forms:

- The native C kernel (CPU) reads and writes tokens by row index, so a mix needs no copies: one
  more call per part index k, over the mixed tokens' k-th parts, each grouped under a *virtual
  slot* per distinct (slot, weight): a row of the pointer table that points at the real slot's
  weights, with scale ``weight * scale``. A token appears once per call, so the kernel's groups,
  which run in parallel, never write one row at once.
- Elsewhere (the torch paths, Triton on CUDA) a mixed token becomes one *virtual row* per part:
  the part's slot, and the token's input times the part's weight (a LoRA delta is linear in its
  input). The virtual rows run through ``add_lora``'s dispatch like any batch, into a scratch
  output that is then added into the mixed tokens' rows, one part at a time.

Ranks may differ between the parts (each slot is cut to its own rank as usual). Parts are
plain LoRA (rsLoRA and rank/alpha patterns included): DoRA's rescale and saved modules are
per adapter, not per delta, so a mix of them is refused before it gets here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from switchboard_kernels.lora_native import NativeGroups

if TYPE_CHECKING:
    from switchboard_kernels.lora import LoraMapping

# (start, end, parts): tokens [start, end) all use the weighted slots ``parts``, (slot, weight).
MixRun = tuple[int, int, Sequence[tuple[int, float]]]


@dataclass(slots=True)
class NativePart:
    """One native call of a mix: the k-th part of every mixed token, by virtual slot."""

    groups: NativeGroups  # token rows grouped by virtual slot j
    sources: torch.Tensor  # [J] int64: the real slot behind virtual slot j
    weights: torch.Tensor  # [J] float32: its weight
    key: tuple  # (sources, weights) as tuples: the virtual slots' identity (NativeSlots.virtual)


@dataclass(slots=True)
class MixRows:
    """A step's mixed tokens, built once per step and shared by every layer: the native calls
    (``native``), or virtual rows laid out run by run, part by part (each part of a run is one
    contiguous segment of one slot, which SGMV and the CPU plans take whole)."""

    rows: torch.Tensor  # [V] int64 on the device: the token each virtual row reads and adds to
    weights: torch.Tensor  # [V, 1] float32 on the device: its part's weight
    # Per part index k: (positions among the virtual rows, their tokens); a token appears at
    # most once in each, so every index_add_ has distinct targets (deterministic on CUDA too).
    parts: list[tuple[torch.Tensor, torch.Tensor]]
    mapping: LoraMapping | None  # over the V virtual rows (None in the native form)
    native: list[NativePart] | None = None

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
        """From the step's runs of mixed tokens; None when there are none. ``native``: the
        native kernel's form."""
        from switchboard_kernels.lora import LoraMapping  # lora imports this module

        if native:
            return _native_form(runs)

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


def _native_form(runs: Sequence[MixRun]) -> MixRows | None:
    """One ``NativePart`` per part index, its tokens grouped by (slot, weight)."""
    calls: list[NativePart] = []
    for k in range(max((len(parts) for _, _, parts in runs), default=0)):
        virtual: dict[tuple[int, float], int] = {}  # (slot, weight) -> virtual slot
        pieces = []
        for start, end, parts in runs:
            if k < len(parts):
                j = virtual.setdefault((parts[k][0], float(parts[k][1])), len(virtual))
                pieces.append((start, end, j))
        sources, weights = [slot for slot, _ in virtual], [w for _, w in virtual]
        calls.append(
            NativePart(
                groups=NativeGroups.from_runs(pieces),
                sources=torch.tensor(sources, dtype=torch.int64),
                weights=torch.tensor(weights, dtype=torch.float32),
                key=(tuple(sources), tuple(weights)),
            )
        )
    if not calls:
        return None
    empty = torch.empty(0, dtype=torch.int64)
    return MixRows(empty, empty.float().reshape(0, 1), [], None, native=calls)
