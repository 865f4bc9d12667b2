"""What a server publishes about its engine: a frozen snapshot, safe to read from any thread.

The engine's loop thread takes one after every step and command batch (``AsyncEngine``);
the gRPC side, the registry heartbeat and Prometheus read the latest without touching the
engine, so scraping costs the step loop nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from worker.core.fairness import TenantService
from worker.core.prefix_cache import PrefixCacheStats
from worker.engine.llm_engine import LLMEngine
from worker.model.lora_manager import AdapterResidency
from worker.spec_decode.stats import SpecDecodeStats

# (device slots refilled while holding another adapter, adapters dropped from the host cache)
AdapterEvictions = tuple[int, int]


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int
    waiting: int
    free_kv_blocks: int
    total_kv_blocks: int
    adapter_ids: tuple[str, ...]  # content ids of the loaded adapters
    prefix_cache: PrefixCacheStats = dataclasses.field(default_factory=PrefixCacheStats)
    spec_decode: SpecDecodeStats | None = None  # None: speculation is off
    adapter_evictions: AdapterEvictions = (0, 0)
    tenants: tuple[TenantService, ...] = ()  # service and queue time per tenant
    # The content in each device slot and in the host cache (empty without LoRA).
    residency: AdapterResidency = dataclasses.field(default_factory=AdapterResidency)
    # Content ids that waiting requests need and no device slot holds (what the Gateway API
    # Inference Extension reads as `waiting_lora_adapters`).
    waiting_adapters: tuple[str, ...] = ()
    # Steps of batch work alone stopped midway for interactive arrivals (and run again).
    batch_steps_stopped: int = 0


def snapshot(engine: LLMEngine) -> EngineStats:
    """The engine's state now; call it on the thread that steps the engine."""
    manager = engine.lora_manager
    names = manager.names if manager is not None else {}
    return EngineStats(
        running=len(engine.scheduler.running),
        waiting=len(engine.scheduler.waiting),
        free_kv_blocks=engine.block_manager.num_free_blocks,
        total_kv_blocks=engine.block_manager.num_blocks,
        adapter_ids=tuple(sorted(set(names.values()))),
        prefix_cache=dataclasses.replace(engine.prefix_cache_stats),
        spec_decode=_copy_spec_stats(engine.spec_decode_stats),
        adapter_evictions=(manager.num_slot_evictions, manager.num_host_evictions)
        if manager is not None
        else (0, 0),
        tenants=engine.scheduler.ledger.snapshot(),
        residency=manager.residency() if manager is not None else AdapterResidency(),
        waiting_adapters=_waiting_adapters(engine) if manager is not None else (),
        batch_steps_stopped=engine.runner.model.interrupt.abandoned,
    )


def _waiting_adapters(engine: LLMEngine) -> tuple[str, ...]:
    """Adapters queued requests wait for: needed by a waiting sequence, in no slot."""
    resident = set(engine.lora_manager.slots)
    needed = dict.fromkeys(i for seq in engine.scheduler.waiting for i in seq.adapter_ids)
    return tuple(i for i in needed if i not in resident)


def _copy_spec_stats(stats: SpecDecodeStats | None) -> SpecDecodeStats | None:
    """A copy the event loop can read while the loop thread keeps counting."""
    if stats is None:
        return None
    return dataclasses.replace(
        stats,
        proposed_per_position=list(stats.proposed_per_position),
        accepted_per_position=list(stats.accepted_per_position),
    )
