"""Adapters in three tiers: store (disk) → host cache (LRU by bytes) → device slots.

S-LoRA (Sheng et al., MLSys 2024): the device slots' weights are stacked per projection, a
row per slot (``worker.model.lora_slots``, which also lays out each rank's shards under tensor
parallelism), so a batch that mixes adapters runs one batched LoRA op per projection.
Adapters of running requests are never evicted: the scheduler admits at most
``max_loras`` distinct adapters, and only slots outside the step's set are reused. Among the
others a new adapter takes the coldest's slot, by decayed request counts that outlive a
slot (``worker.model.slot_eviction``), an adapter with queued requests last. Under tensor
parallelism each slot is filled on every rank (rank 0 records its fills, which travel with
the next step).

DoRA adapters (``worker.model.dora``): each DoRA module's factor ``g`` is computed when the
adapter is read, kept beside it in the host cache, and written with the slot; a step that
holds a DoRA slot rescales those rows after the LoRA delta. Not under tensor parallelism
(refused at load).

Saved modules (modules_to_save: embed_tokens, lm_head; ``worker.model.saved_modules``): a slot
filled with such an adapter holds its copies on the device in the model's dtype; a step's rows
of that slot take embeddings and logits from them. Not under tensor parallelism either.

Mixes (``worker.core.adapter_mix``): a row that asks for several adapters with weights needs each
of them in a slot; its tokens are -1 in the step's mapping and run as weighted virtual rows
beside it (``switchboard_kernels.lora_mix``). Only plain LoRA adapters mix (``check_mix``).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from adapters.base_model import EXPERT_PROJECTIONS, BaseModelSpec
from adapters.errors import UnsupportedAdapterFeatureError
from adapters.lora import LoraAdapter
from adapters.peft_format import load_adapter_dir
from switchboard_kernels.lora import LoraMapping, MixRows, NativeSlots
from switchboard_kernels.lora_mix import MixRun
from worker.core.adapter_mix import AdapterMix
from worker.errors import InvalidRequestError, UnknownAdapterError
from worker.model.dora import BaseWeights, DoraFactors, dora_factors
from worker.model.expert_lora import ExpertLora, ExpertSlots
from worker.model.lora_slots import LoraSlots, SlotStack
from worker.model.op_choice import OpPlans
from worker.model.quantize_on_load import OnLoad
from worker.model.saved_modules import SavedRows, SlotModules
from worker.model.sharding import Shard
from worker.model.slot_eviction import SlotEviction

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoraBatch:
    """What the model needs to apply LoRA in one step."""

    mapping: LoraMapping
    stacks: list[dict[str, SlotStack]]  # per layer, by LoRA group (LORA_GROUPS)
    token_slots: list[int]  # each token's slot, -1 for none (as the mapping holds them)
    dora: bool = False  # some token's slot holds a DoRA adapter: rescale after the delta
    # Per layer: a MoE base's expert LoRA (``worker.model.expert_lora``), None on dense layers.
    experts: list[ExpertSlots | None] | None = None
    # The step's mixed tokens as weighted virtual rows (they are -1 in ``mapping``), if any.
    mix: MixRows | None = None

    def expert_lora(self, layer: int) -> ExpertLora | None:
        """Layer ``layer``'s expert LoRA for this step, None where no adapter has any."""
        slots = None if self.experts is None else self.experts[layer]
        if slots is None or not slots.used or not self.mapping.any_lora:
            return None
        return ExpertLora(slots, self.mapping.token_slots)

    # The step's slots with saved embed_tokens / lm_head copies or token rows, if any.
    saved: SavedRows | None = None

    @property
    def eager(self) -> bool:
        """Not replayed as a captured CUDA graph (DoRA's rescale, saved copies and mixes are
        not)."""
        return self.dora or self.saved is not None or self.mix is not None


@dataclass(frozen=True, slots=True)
class AdapterResidency:
    """Where adapters' weights are: per device slot (None: empty) and in the host cache."""

    slots: tuple[str | None, ...] = ()  # content id held by each slot, by slot index
    host: tuple[str, ...] = ()  # content ids in the host cache, most recently used first
    host_bytes: int = 0  # float32 bytes those take
    host_limit: int = 0  # the host cache's byte budget


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
        shard: Shard | None = None,
        ops: OpPlans | None = None,
        on_load: OnLoad | None = None,
    ) -> None:
        """``shard``: this rank's place in a tensor-parallel group; its slots hold S-LoRA's
        shards, for the split shrink and expand (no native kernel or prepacked pairs).
        ``ops``: which steps, by token count, take the native kernel (``op_choice``; None:
        every step where it builds). ``on_load``: the base is quantized as it loads (DoRA's
        factors then come from its dequantized weights)."""
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
        self.slot_use: list[int] = [0] * max_loras  # step of last use, among equals
        # Which slot a new adapter takes: the engine reports arrivals and departures to it.
        self.eviction = SlotEviction()
        self.slot_dora: list[bool] = [False] * max_loras  # the slot's adapter is DoRA
        # The slot's adapter's modules_to_save copies and token rows on the device (None: none).
        self.slot_saved: list[SlotModules | None] = [None] * max_loras
        self.base_weights = BaseWeights(model_path, dtype, on_load)  # for DoRA's factors
        # Why an adapter may not be part of a mix (content id -> the feature), set when named.
        self.unmixable: dict[str, str] = {}
        # DoRA's factors of the adapters read (content id -> g per module), computed by
        # ``read`` off the step loop; dropped with the adapter from the host cache.
        self.dora: dict[str, DoraFactors] = {}
        self._step = 0
        self._slots: LoraSlots | None = None  # allocated on first load
        self.num_slot_loads = 0
        # Evictions, for metrics: a slot refilled while it held another adapter, and an
        # adapter dropped from the host cache (it is read from the store again when needed).
        self.num_slot_evictions = 0
        self.num_host_evictions = 0
        self.shard = shard
        # Rank 0 of a group: the slots filled since the last step, (slot, content id, path).
        recording = shard is not None and shard.rank == 0
        self._fills: list[tuple[int, str, str]] | None = [] if recording else None
        # bf16 or fp32 on CPU: the native kernel, built here (about a second, once per machine and
        # source) rather than inside the first adapter load. It fuses shrink and expand, so a
        # rank of a tensor-parallel group, which exchanges between them, does without it.
        probe = torch.empty(0, dtype=dtype, device=self.device)
        self.native = shard is None and NativeSlots.wanted(probe)
        self.ops = ops
        if self.device.type == "cpu":
            kernel = "native kernel" if self.native else "torch paths"
            logger.info("LoRA on CPU in %s: %s", str(dtype).removeprefix("torch."), kernel)

    @property
    def stacks(self) -> list[dict[str, SlotStack]] | None:
        """The slots' weights: per layer, by LoRA group; None before the first adapter."""
        return None if self._slots is None else self._slots.stacks

    def _allocated(self) -> LoraSlots:
        """The slots' weights, allocated with the first adapter (their size is fixed by
        ``max_loras`` and ``max_lora_rank``, so a server without adapters never holds them)."""
        if self._slots is None:
            self._slots = LoraSlots(
                self.spec,
                dtype=self.dtype,
                device=self.device,
                max_loras=self.max_loras,
                max_lora_rank=self.max_lora_rank,
                shard=self.shard,
                native=self.native,
            )
        return self._slots

    # --- registry ---------------------------------------------------------------------

    def load(self, name: str, path: str | Path) -> str:
        """Read and validate an adapter, name it; returns its content id.

        Loading new weights under a known name re-points the name: requests already
        running keep the old adapter, new ones get the new one.
        """
        return self.add(name, self.read(path), path)

    def read(self, path: str | Path) -> LoraAdapter:
        """Read and validate an adapter's files, and compute DoRA's factors (safe off the
        step loop: the only state touched is the factors' cache, keyed by content)."""
        adapter = load_adapter_dir(
            Path(path),
            base=self.spec,
            max_lora_rank=self.max_lora_rank,
            max_bytes=self.max_adapter_bytes,
        )
        if (adapter.saved or adapter.tokens is not None) and self.shard is not None:
            field = "modules_to_save" if adapter.saved else "trainable_token_indices"
            raise UnsupportedAdapterFeatureError(
                f"{field} is not served under tensor parallelism", field=field
            )
        if adapter.uses_dora and adapter.id not in self.dora:
            if self.shard is not None:
                raise UnsupportedAdapterFeatureError(
                    "DoRA (use_dora) is not served under tensor parallelism", field="use_dora"
                )
            self.dora[adapter.id] = dora_factors(adapter, self.base_weights)
        return adapter

    def add(self, name: str, adapter: LoraAdapter, path: str | Path) -> str:
        """Name an adapter already read by `read` from `path` (kept to reload it later)."""
        self.names[name] = adapter.id
        self.paths[adapter.id] = Path(path)
        reason = _unmixable(adapter)
        if reason is not None:
            self.unmixable[adapter.id] = reason
        self._cache(adapter)
        self._allocated()
        return adapter.id

    def unload(self, name: str) -> None:
        if self.names.pop(name, None) is None:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded")

    def resolve(self, name: str) -> str:
        try:
            return self.names[name]
        except KeyError:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded") from None

    def check_mix(self, names: list[str], mix: AdapterMix) -> None:
        """A mix's adapters (named ``names``, in ``mix.ids``' order) may be summed: plain LoRA
        only, and not under tensor parallelism."""
        if self.shard is not None:
            raise InvalidRequestError("adapter mixes are not served under tensor parallelism")
        for name, adapter_id in zip(names, mix.ids, strict=True):
            reason = self.unmixable.get(adapter_id)
            if reason is not None:
                raise InvalidRequestError(
                    f"adapter {name!r} uses {reason}, which is not served in a mix: a mix sums "
                    "plain LoRA deltas only"
                )

    # --- per step ---------------------------------------------------------------------

    def prepare(
        self, token_adapters: list[str | AdapterMix | None], *, all_decode: bool
    ) -> LoraBatch | None:
        """Put this step's adapters (a mix's each) in slots; the mapping from tokens to slots."""
        distinct = {a for a in token_adapters if a is not None}
        needed = {i for a in distinct for i in (a.ids if isinstance(a, AdapterMix) else (a,))}
        if not needed:
            return None
        self._step += 1
        slot_of = {adapter: self._slot_for(adapter, needed) for adapter in needed}
        token_slots = [slot_of[a] if isinstance(a, str) else -1 for a in token_adapters]
        runs: list[MixRun] = []
        mixes = any(isinstance(a, AdapterMix) for a in distinct)
        for t, a in enumerate(token_adapters if mixes else ()):
            if not isinstance(a, AdapterMix):
                continue
            if runs and runs[-1][1] == t and token_adapters[t - 1] is a:
                runs[-1] = (runs[-1][0], t + 1, runs[-1][2])
            else:
                runs.append((t, t + 1, [(slot_of[i], w) for i, w in a.parts]))
        return self.batch(token_slots, all_decode, mix_runs=runs)

    def plain_in_slots(self, adapters: list[str | None]) -> bool:
        """Whether each of these adapters (None: a base row) is in a slot already, none DoRA
        or with saved modules, on one rank with the native kernel: a step ``prepare`` then
        lays out for the native decode step (decode_step_cpu.c) without loading anything."""
        if not self.native or self.shard is not None:
            return False
        for adapter in set(adapters) - {None}:
            if adapter not in self.slots:
                return False
            slot = self.slots.index(adapter)
            if self.slot_dora[slot] or self.slot_saved[slot] is not None:
                return False
        return self._slots is None or self._slots.experts is None

    def batch(
        self, token_slots: list[int], all_decode: bool, *, mix_runs: list[MixRun] | None = None
    ) -> LoraBatch:
        """The step's LoRA from each token's slot (-1: none) and the runs of mixed tokens,
        (start, end, [(slot, weight), ...]), their slots already filled."""
        slots = self._allocated()
        native = self.native and (self.ops is None or self.ops.native_lora(len(token_slots)))
        mapping = LoraMapping.build(
            token_slots, device=self.device, all_decode=all_decode, native=native
        )
        mix = None
        if mix_runs:
            rows = sum((end - start) * len(parts) for start, end, parts in mix_runs)
            native = self.native and (self.ops is None or self.ops.native_lora(rows))
            mix = MixRows.build(mix_runs, device=self.device, all_decode=all_decode, native=native)
        used = {s for s in token_slots if s >= 0}
        dora = any(self.slot_dora) and any(self.slot_dora[s] for s in used)
        saved = None
        with_saved = {s: self.slot_saved[s] for s in used if self.slot_saved[s] is not None}
        if with_saved:
            on_device = torch.tensor(token_slots, dtype=torch.int64).to(self.device)
            saved = SavedRows(on_device, with_saved)  # type: ignore[arg-type]
        return LoraBatch(
            mapping,
            slots.stacks,
            token_slots,
            dora=dora,
            experts=slots.experts,
            mix=mix,
            saved=saved,
        )

    def take_fills(self) -> list[tuple[int, str, str]]:
        """Rank 0 of a group: the slots filled since the last call, for the other ranks."""
        fills = self._fills or []
        if self._fills is not None:
            self._fills = []
        return fills

    def fill(self, slot: int, adapter_id: str, path: str | Path) -> None:
        """Another rank: put adapter ``adapter_id`` (read from ``path`` unless cached) in
        ``slot``, as rank 0 did."""
        self._allocated()
        self.paths[adapter_id] = Path(path)
        self._fill_slot(slot, self._host_get(adapter_id))

    def _slot_for(self, adapter_id: str, needed: set[str]) -> int:
        if adapter_id in self.slots:
            slot = self.slots.index(adapter_id)
        else:
            slot = self.eviction.victim(self.slots, self.slot_use, needed)
            evicting = self.slots[slot] is not None
            self._fill_slot(slot, self._host_get(adapter_id))
            self.num_slot_evictions += evicting
        self.slot_use[slot] = self._step
        return slot

    def _fill_slot(self, slot: int, adapter: LoraAdapter) -> None:
        factors = self.dora.get(adapter.id) if adapter.uses_dora else None
        if adapter.uses_dora and factors is None:  # dropped from the host cache meanwhile
            factors = self.dora[adapter.id] = dora_factors(adapter, self.base_weights)
        self._allocated().fill(slot, adapter, factors)
        self.slots[slot] = adapter.id
        self.slot_dora[slot] = bool(factors)
        self.slot_saved[slot] = None  # the old copies go before the new ones are made
        if adapter.saved or adapter.tokens is not None:
            tied = self.spec.tie_word_embeddings
            self.slot_saved[slot] = SlotModules.of(adapter, self.dtype, self.device, tied_base=tied)
        self.num_slot_loads += 1
        if self._fills is not None:
            self._fills.append((slot, adapter.id, str(self.paths[adapter.id])))

    # --- host cache -------------------------------------------------------------------

    def residency(self) -> AdapterResidency:
        """Which content sits in each device slot and in the host cache now (for the fleet
        view; call it on the thread that steps the engine)."""
        return AdapterResidency(
            slots=tuple(self.slots),
            host=tuple(reversed(self.host)),
            host_bytes=sum(a.num_bytes for a in self.host.values()),
            host_limit=self.host_cache_bytes,
        )

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
            self.dora.pop(evicted.id, None)
            total -= evicted.num_bytes
            self.num_host_evictions += 1


def _unmixable(adapter: LoraAdapter) -> str | None:
    """The feature of ``adapter`` a weighted sum of deltas cannot express, if any: DoRA rescales
    by its own adapted weight's norm, saved copies and token rows replace rather than add, and
    expert LoRA takes another path."""
    if adapter.uses_dora:
        return "DoRA (use_dora)"
    if adapter.saved:
        return "modules_to_save"
    if adapter.tokens is not None:
        return "trainable_token_indices"
    if any(module in EXPERT_PROJECTIONS for _, module in adapter.weights):
        return "LoRA on MoE experts (target_parameters)"
    return None
