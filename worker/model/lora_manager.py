"""Adapters in three tiers: store (disk) → host cache (LRU by bytes) → device slots.

S-LoRA (Sheng et al., MLSys 2024) and Punica: every targeted projection keeps one stacked
A and B buffer with a row per device slot, padded to ``max_lora_rank``, so a batch that
mixes adapters (and requests with none) runs one batched LoRA op per projection. A slot
whose adapter lacks a projection or a layer holds zeros there, which adds nothing.
Adapters of running requests are never evicted: the scheduler admits at most
``max_loras`` distinct adapters, and only slots outside the step's set are reused.

Projections that share an input are fused into one LoRA group (q/k/v, gate/up): their A
matrices stack along the rank and their B matrices form a block diagonal, with each
module's scaling folded into its B block. On CPU each LoRA call has a fixed cost of tens of
microseconds (bench/lora_ops.py), so four calls per layer instead of seven matter more than
the zeros the block diagonal multiplies.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from adapters.base_model import BaseModelSpec
from adapters.lora import LoraAdapter
from adapters.peft_format import load_adapter_dir
from kernels.lora import LoraMapping, NativeSlots, SlotPairs
from worker.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class UnknownAdapterError(InvalidRequestError):
    """A request named an adapter that is not loaded."""


# LoRA groups of a layer: projections sharing one input, in their fused output order.
LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


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


@dataclass(slots=True)
class LoraBatch:
    """What the model needs to apply LoRA in one step."""

    mapping: LoraMapping
    stacks: list[dict[str, SlotStack]]  # per layer, by LoRA group (LORA_GROUPS)


class LoraManager:
    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        max_loras: int = 8,
        max_lora_rank: int = 32,
        max_adapter_bytes: int = 512 * 2**20,
        host_cache_bytes: int = 2 * 2**30,
    ) -> None:
        config = json.loads((Path(model_path) / "config.json").read_text())
        self.spec = BaseModelSpec.from_config_dict(config)
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_adapter_bytes = max_adapter_bytes
        self.host_cache_bytes = host_cache_bytes
        self.names: dict[str, str] = {}  # adapter name -> content id
        self.paths: dict[str, Path] = {}  # content id -> directory to reload from
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()  # LRU, newest last
        self.slots: list[str | None] = [None] * max_loras  # content id held by each slot
        self.slot_use: list[int] = [0] * max_loras  # step of last use, for LRU
        self._step = 0
        self._stacks: list[dict[str, SlotStack]] | None = None  # allocated on first load
        self.num_slot_loads = 0
        # Evictions, for metrics: a slot refilled while it held another adapter, and an
        # adapter dropped from the host cache (it is read from the store again when needed).
        self.num_slot_evictions = 0
        self.num_host_evictions = 0
        # bf16 or fp32 on CPU: the native kernel, built here (about a second, once per machine and
        # source) rather than inside the first adapter load.
        self.native = NativeSlots.wanted(torch.empty(0, dtype=dtype, device=self.device))
        if self.device.type == "cpu":
            kernel = "native kernel" if self.native else "torch paths"
            logger.info("LoRA on CPU in %s: %s", str(dtype).removeprefix("torch."), kernel)

    @property
    def stacks(self) -> list[dict[str, SlotStack]] | None:
        """The slots' weights: per layer, by LoRA group; None before the first adapter."""
        return self._stacks

    # --- registry ---------------------------------------------------------------------

    def load(self, name: str, path: str | Path) -> str:
        """Read and validate an adapter, name it; returns its content id.

        Loading new weights under a known name re-points the name: requests already
        running keep the old adapter, new ones get the new one.
        """
        return self.add(name, self.read(path), path)

    def read(self, path: str | Path) -> LoraAdapter:
        """Read and validate an adapter's files (no state touched: safe off the step loop)."""
        return load_adapter_dir(
            Path(path),
            base=self.spec,
            max_lora_rank=self.max_lora_rank,
            max_bytes=self.max_adapter_bytes,
        )

    def add(self, name: str, adapter: LoraAdapter, path: str | Path) -> str:
        """Name an adapter already read by `read` from `path` (kept to reload it later)."""
        self.names[name] = adapter.id
        self.paths[adapter.id] = Path(path)
        self._cache(adapter)
        if self._stacks is None:
            self._stacks = self._allocate()
        return adapter.id

    def unload(self, name: str) -> None:
        if self.names.pop(name, None) is None:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded")

    def resolve(self, name: str) -> str:
        try:
            return self.names[name]
        except KeyError:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded") from None

    # --- per step ---------------------------------------------------------------------

    def prepare(self, token_adapters: list[str | None], *, all_decode: bool) -> LoraBatch | None:
        """Put this step's adapters in slots; the mapping from tokens to slots."""
        needed = {a for a in token_adapters if a is not None}
        if not needed:
            return None
        self._step += 1
        slot_of = {adapter: self._slot_for(adapter, needed) for adapter in needed}
        slots = [-1 if a is None else slot_of[a] for a in token_adapters]
        assert self._stacks is not None
        mapping = LoraMapping.build(
            slots, device=self.device, all_decode=all_decode, native=self.native
        )
        return LoraBatch(mapping, self._stacks)

    def _slot_for(self, adapter_id: str, needed: set[str]) -> int:
        if adapter_id in self.slots:
            slot = self.slots.index(adapter_id)
        else:
            free = [i for i, held in enumerate(self.slots) if held not in needed]
            slot = min(free, key=lambda i: (self.slots[i] is not None, self.slot_use[i]))
            evicting = self.slots[slot] is not None
            self._fill_slot(slot, self._host_get(adapter_id))
            self.num_slot_evictions += evicting
        self.slot_use[slot] = self._step
        return slot

    def _fill_slot(self, slot: int, adapter: LoraAdapter) -> None:
        assert self._stacks is not None
        rank = self.max_lora_rank
        for layer, stacks in enumerate(self._stacks):
            for group, stack in stacks.items():
                stack.a[slot].zero_()
                stack.b[slot].zero_()
                stack.scales[slot] = 1.0
                row = 0
                for m, module in enumerate(LORA_GROUPS[group]):
                    out_features = self.spec.projection_shape(module)[1]
                    weights = adapter.weights.get((layer, module))
                    if weights is not None:
                        r, cols = weights.rank, slice(m * rank, m * rank + weights.rank)
                        stack.a[slot, cols].copy_(torch.from_numpy(weights.a.copy()))
                        scaled_b = torch.from_numpy(weights.b * np.float32(weights.scaling))
                        stack.b[slot, row : row + out_features, cols].copy_(scaled_b[:, :r])
                        stack.used = True
                    row += out_features
                if stack.pairs is not None:
                    stack.pairs.refresh(slot, stack.a, stack.b)
                if stack.native is not None:
                    stack.native.refresh(slot, stack.a[slot], stack.b[slot])
        self.slots[slot] = adapter.id
        self.num_slot_loads += 1

    # --- host cache -------------------------------------------------------------------

    def _host_get(self, adapter_id: str) -> LoraAdapter:
        adapter = self.host.get(adapter_id)
        if adapter is not None:
            self.host.move_to_end(adapter_id)
            return adapter
        adapter = self.read(self.paths[adapter_id])
        if adapter.id != adapter_id:
            raise InvalidRequestError(
                f"adapter files in {self.paths[adapter_id]} changed since they were loaded"
            )
        self._cache(adapter)
        return adapter

    def _cache(self, adapter: LoraAdapter) -> None:
        self.host[adapter.id] = adapter
        self.host.move_to_end(adapter.id)
        total = sum(a.num_bytes for a in self.host.values())
        while total > self.host_cache_bytes and len(self.host) > 1:
            _, evicted = self.host.popitem(last=False)
            total -= evicted.num_bytes
            self.num_host_evictions += 1

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
            for group, modules in LORA_GROUPS.items():
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
