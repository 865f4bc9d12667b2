"""The device slots' LoRA weights: one stacked A and B buffer per layer and LoRA group, a row
per slot (S-LoRA, Sheng et al., MLSys 2024; Punica), allocated and filled here.

Every targeted projection's buffer is padded to ``max_lora_rank``, so a batch that mixes
adapters (and requests with none) runs one batched LoRA op per projection. A slot whose
adapter lacks a projection or a layer holds zeros there, which adds nothing.

Projections that share an input are fused into one LoRA group (q/k/v, gate/up): their A
matrices stack along the rank and their B matrices form a block diagonal, with each
module's scaling folded into its B block. On CPU each LoRA call has a fixed cost of tens of
microseconds (bench/lora_ops.py), so four calls per layer instead of seven matter more than
the zeros the block diagonal multiplies.

Under tensor parallelism (``shard``) each rank's slots hold its part of every adapter as
S-LoRA partitions it (section 5), lined up with the base layer's split
(``worker.model.sharding``). Column-parallel groups (q/k/v, gate/up): A split along the rank
(each adapter's r rows in ``size`` chunks), B along its outputs like the base weight, its
columns laid out as the ranks' shrink outputs arrive from the all-gather. Row-parallel
groups (o, down): A split along its inputs like the base weight (the shrink is a partial
sum, all-reduced), B along its outputs, added into this rank's columns of the partial sum
that the base layer's all-reduce completes. A MoE base's expert LoRA is split with no
exchange of its own (``sharding.expert_lora_shard``).

DoRA (``worker.model.dora``): each DoRA module's factor ``g`` is written per slot into the
group's ``DoraScales`` (ones for the modules and slots without DoRA). Which adapter goes to
which slot, and when, is the manager's (``worker.model.lora_manager``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from adapters.base_model import EXPERT_PROJECTIONS, BaseModelSpec
from adapters.lora import LoraAdapter, LoraWeights
from switchboard_kernels.lora import DoraScales, NativeSlots, SlotPairs
from worker.model.dora import DoraFactors
from worker.model.expert_lora import ExpertSlots
from worker.model.sharding import FUSED_PARTS, Shard, expert_lora_shard

# LoRA groups of a layer: projections sharing one input, in their fused output order.
LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# Phi-3's checkpoint fuses q/k/v and gate/up, and PEFT adapts the fused modules.
FUSED_LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("qkv_proj",),
    "o": ("o_proj",),
    "gate_up": ("gate_up_proj",),
    "down": ("down_proj",),
}
# Groups whose base projections are row-parallel under tensor parallelism.
ROW_PARALLEL_GROUPS = ("o", "down")


@dataclass(slots=True)
class SlotStack:
    """One LoRA group of one layer, across all slots.

    Module ``m`` (the m-th of the group) owns A rows and B columns ``m*R .. m*R + r`` and
    B rows at its offset in the group's fused output; scaling is folded into B.
    """

    a: torch.Tensor  # [max_loras, modules * max_rank, in_features]
    b: torch.Tensor  # [max_loras, fused_out_features, modules * max_rank]
    scales: torch.Tensor  # [max_loras] float32, 1.0 for every filled slot
    pairs: SlotPairs | None = None  # CPU fp16 (or bf16 without native): cut to rank, packed
    native: NativeSlots | None = None  # CPU bf16/fp32: slots cut to rank for the native kernel
    used: bool = False  # some adapter ever targeted this group (else skip the call)
    # Tensor parallelism: a row-parallel group's B writes these columns of the partial sum.
    row_parallel: bool = False
    out_offset: int = 0
    dora: DoraScales | None = None  # made when a DoRA adapter first targets this group


class LoraSlots:
    """Every layer's slot stacks by LoRA group (and a MoE base's expert slots, made with the
    first adapter that has expert LoRA), and how an adapter's weights are written into a slot."""

    def __init__(
        self,
        spec: BaseModelSpec,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_loras: int,
        max_lora_rank: int,
        shard: Shard | None,
        native: bool,
    ) -> None:
        """``native``: the slots keep the native kernel's packed copies (CPU bf16/fp32, one
        rank); else, where the torch path prepacks, its fp16 pairs."""
        self.spec = spec
        fused = "qkv_proj" in spec.projections
        self.groups = FUSED_LORA_GROUPS if fused else LORA_GROUPS
        self.dtype = dtype
        self.device = device
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.shard = shard
        self.native = native
        self.stacks = self._allocate() if shard is None else self._allocate_shards(shard)
        self.experts: list[ExpertSlots | None] | None = None

    def fill(self, slot: int, adapter: LoraAdapter, factors: DoraFactors | None) -> None:
        """``adapter``'s weights (and its DoRA ``factors``, if any) into ``slot``, every
        group of every layer, the slot's old contents cleared first."""
        rank = self.max_lora_rank
        for layer, stacks in enumerate(self.stacks):
            for group, stack in stacks.items():
                stack.a[slot].zero_()
                stack.b[slot].zero_()
                stack.scales[slot] = 1.0
                if self.shard is not None:
                    self._fill_shard(stack, group, layer, slot, adapter, self.shard)
                    continue
                row = 0
                for m, module in enumerate(self.groups[group]):
                    out_features = self.spec.projection_shape(module)[1]
                    weights = adapter.weights.get((layer, module))
                    if weights is not None:
                        r, cols = weights.rank, slice(m * rank, m * rank + weights.rank)
                        stack.a[slot, cols].copy_(torch.from_numpy(weights.a.copy()))
                        scaled_b = torch.from_numpy(weights.b * np.float32(weights.scaling))
                        stack.b[slot, row : row + out_features, cols].copy_(scaled_b[:, :r])
                        stack.used = True
                    row += out_features
                self._fill_dora(stack, group, layer, slot, factors)
                if stack.pairs is not None:
                    stack.pairs.refresh(slot, stack.a, stack.b)
                if stack.native is not None:
                    stack.native.refresh(slot, stack.a[slot], stack.b[slot])
        if self.spec.num_experts:
            self._fill_experts(slot, adapter)

    def _fill_dora(
        self, stack: SlotStack, group: str, layer: int, slot: int, factors: DoraFactors | None
    ) -> None:
        """The group's DoRA factor of ``slot`` (ones for its modules without DoRA), or its
        slot turned off when the group has no DoRA module of this adapter."""
        modules = self.groups[group]
        if not factors or all((layer, m) not in factors for m in modules):
            if stack.dora is not None:
                stack.dora.set(slot, None)
            return
        spans = self._outputs(modules)
        if stack.dora is None:
            stack.dora = DoraScales.allocate(self.max_loras, spans[-1][1], self.device)
        g = torch.ones(spans[-1][1], dtype=torch.float32)
        for module, (begin, end) in zip(modules, spans, strict=True):
            if (layer, module) in factors:
                g[begin:end] = factors[(layer, module)]
        stack.dora.set(slot, g.to(self.device))

    def _fill_experts(self, slot: int, adapter: LoraAdapter) -> None:
        """A MoE base's expert LoRA of ``adapter`` into ``slot``. The expert slots are large (per
        sparse layer, experts x slots x max_lora_rank x (2 hidden + 3 intermediate)), so they are
        allocated with the first adapter that has expert LoRA."""
        spec, shard = self.spec, self.shard
        if self.experts is None:
            if not any(module in EXPERT_PROJECTIONS for _, module in adapter.weights):
                return
            size = 1 if shard is None else shard.size
            self.experts = [
                ExpertSlots.allocate(
                    experts=spec.num_experts,
                    slots=self.max_loras,
                    max_rank=self.max_lora_rank,
                    hidden=spec.hidden_size,
                    intermediate=spec.expert_intermediate_size // size,  # this rank's
                    dtype=self.dtype,
                    device=self.device,
                )
                if sparse
                else None
                for sparse in spec.sparse_layers
            ]

        def get(layer: int, module: str) -> LoraWeights | None:
            w = adapter.weights.get((layer, module))
            if w is None or shard is None:
                return w
            return expert_lora_shard(w, module, spec.expert_intermediate_size, shard)

        for layer, experts in enumerate(self.experts):
            if experts is not None:
                experts.fill(
                    slot, get(layer, "experts.gate_up_proj"), get(layer, "experts.down_proj")
                )

    def _fill_shard(
        self,
        stack: SlotStack,
        group: str,
        layer: int,
        slot: int,
        adapter: LoraAdapter,
        shard: Shard,
    ) -> None:
        """This rank's S-LoRA shard of one group of ``adapter`` into ``slot`` (see the
        module docstring; ``_allocate`` sizes the stacks)."""
        modules = self.groups[group]
        width = stack.a.shape[1] // len(modules)  # A rows per module on this rank
        row = 0
        for m, module in enumerate(modules):
            in_features = self.spec.projection_shape(module)[0]
            out_rows = self._shard_rows(module, shard)
            weights = adapter.weights.get((layer, module))
            if weights is not None:
                r = weights.rank
                a = torch.from_numpy(weights.a.copy())  # [r, in]
                b = torch.from_numpy(weights.b * np.float32(weights.scaling))[out_rows]
                if stack.row_parallel:  # A by input features, B by output features
                    stack.a[slot, :r].copy_(a[:, shard.span(in_features)])
                    stack.b[slot, :, :r].copy_(b)
                else:  # A by rank, in chunks; B's columns where the all-gather puts them
                    chunk = math.ceil(r / shard.size)
                    for j in range(shard.size):
                        ranks = slice(min(j * chunk, r), min((j + 1) * chunk, r))
                        n = ranks.stop - ranks.start
                        if j == shard.rank:
                            stack.a[slot, m * width : m * width + n].copy_(a[ranks])
                        col = (j * len(modules) + m) * width
                        stack.b[slot, row : row + b.shape[0], col : col + n].copy_(b[:, ranks])
                stack.used = True
            row += len(out_rows)

    def _shard_rows(self, module: str, shard: Shard) -> torch.Tensor:
        """This rank's output rows of ``module``, as the base weight's split has them (Phi-3's
        fused modules: its share of each part)."""
        parts = FUSED_PARTS.get(module, (module,))
        spans = shard.part_spans([self.spec.projection_shape(p)[1] for p in parts])
        return torch.cat([torch.arange(s.start, s.stop) for s in spans])

    def _outputs(self, modules: tuple[str, ...]) -> list[tuple[int, int]]:
        """Each module's (begin, end) columns in its group's fused output."""
        spans, start = [], 0
        for module in modules:
            end = start + self.spec.projection_shape(module)[1]
            spans.append((start, end))
            start = end
        return spans

    def _allocate(self) -> list[dict[str, SlotStack]]:
        rank, slots = self.max_lora_rank, self.max_loras
        stacks = []
        for _ in range(self.spec.num_layers):
            layer = {}
            for group, modules in self.groups.items():
                in_features = self.spec.projection_shape(modules[0])[0]
                out_features = sum(self.spec.projection_shape(m)[1] for m in modules)
                width = rank * len(modules)
                on = {"dtype": self.dtype, "device": self.device}
                a = torch.zeros(slots, width, in_features, **on)
                native = self.native
                layer[group] = SlotStack(
                    a=a,
                    b=torch.zeros(slots, out_features, width, **on),
                    scales=torch.zeros(slots, dtype=torch.float32, device=self.device),
                    pairs=SlotPairs(slots, self.dtype)
                    if SlotPairs.wanted(a) and not native
                    else None,
                    native=NativeSlots(slots, in_features, self._outputs(modules), self.dtype)
                    if native
                    else None,
                )
            stacks.append(layer)
        return stacks

    def _allocate_shards(self, shard: Shard) -> list[dict[str, SlotStack]]:
        """Slot stacks for this rank's shards: a row-parallel group's A [slots, R, in / size]
        and B [slots, out / size, R]; a column-parallel group's A [slots, modules * w, in]
        (w = ceil(R / size) of each module's ranks) and B [slots, out / size, size *
        modules * w] (all the ranks, as gathered)."""
        rank, slots = self.max_lora_rank, self.max_loras
        on = {"dtype": self.dtype, "device": self.device}
        width = math.ceil(rank / shard.size)
        stacks = []
        for _ in range(self.spec.num_layers):
            layer = {}
            for group, modules in self.groups.items():
                in_features = self.spec.projection_shape(modules[0])[0]
                out_local = sum(self.spec.projection_shape(m)[1] for m in modules) // shard.size
                row_parallel = group in ROW_PARALLEL_GROUPS
                if row_parallel:
                    a_shape = (slots, rank, in_features // shard.size)
                    b_shape = (slots, out_local, rank)
                else:
                    a_shape = (slots, len(modules) * width, in_features)
                    b_shape = (slots, out_local, shard.size * len(modules) * width)
                layer[group] = SlotStack(
                    a=torch.zeros(a_shape, **on),
                    b=torch.zeros(b_shape, **on),
                    scales=torch.zeros(slots, dtype=torch.float32, device=self.device),
                    row_parallel=row_parallel,
                    out_offset=shard.rank * out_local if row_parallel else 0,
                )
            stacks.append(layer)
        return stacks
