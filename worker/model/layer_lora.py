"""A step's LoRA for one layer of our decoder (``worker.model.llama``): its deltas added into
the layer's fused projection outputs, on one rank or split across a tensor-parallel group."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from switchboard_kernels.lora import add_lora, lora_expand, lora_shrink

if TYPE_CHECKING:
    from worker.model.lora_manager import LoraBatch
    from worker.model.parallel_group import TensorParallelGroup


class LayerLora:
    """Adds the step's LoRA deltas into one layer's fused projection outputs.

    Under tensor parallelism the slots hold S-LoRA's shards (``worker.model.lora_slots``):
    shrink and expand run apart, with the rank-sized exchange between them, an all-gather
    for a column-parallel group and an all-reduce for a row-parallel one."""

    __slots__ = ("dora", "group", "mapping", "mix", "stacks")

    def __init__(self, lora: LoraBatch, layer: int, group: TensorParallelGroup | None) -> None:
        self.mapping = lora.mapping
        self.stacks = lora.stacks[layer]
        self.group = group
        self.dora = lora.dora
        self.mix = lora.mix  # mixed rows (never under tensor parallelism: refused per request)

    def add(
        self, y: torch.Tensor, x: torch.Tensor, lora_group: str, *, base: torch.Tensor | None = None
    ) -> None:
        """``y += LoRA_group(x)``: y is the group's fused projection output (row-parallel
        under tensor parallelism: this rank's partial sum, full width). DoRA rows are then
        rescaled, all of y but ``base`` (the bias or residual in y: [out] or [T, out])."""
        s = self.stacks[lora_group]
        if not s.used:
            return
        if self.group is None:
            dora = s.dora if self.dora else None
            add_lora(
                y, x, s.a, s.b, s.scales, self.mapping, pairs=s.pairs, native=s.native,
                dora=dora, dora_base=base, mix=self.mix,
            )  # fmt: skip
            return
        if not self.mapping.any_lora:
            return
        h = lora_shrink(x, s.a, self.mapping)  # [T, this rank's share]
        # Row-parallel: partial sums over the input split -> [T, R]; column-parallel: each
        # rank's share of the ranks side by side -> [T, size * w].
        h = self.group.all_reduce(h) if s.row_parallel else self.group.all_gather(h)
        lora_expand(y, h, s.b, s.scales, self.mapping, out_offset=s.out_offset)
