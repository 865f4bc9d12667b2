"""LoRA affinity: how well a worker can take a request on an adapter now, as the Kubernetes
Gateway API Inference Extension scores pods (its `lora_affinity` scorer, read from the model
servers' `running_lora_adapters`, `waiting_lora_adapters` and `max_lora`):

    1.0  the adapter is resident: in a device slot (for a worker that reports no slots, an
         older one: loaded at all)
    0.8  it is not, but a device slot is free: loading it evicts nothing
    0.6  requests already wait there for it to get a slot: it is being brought in
    0.0  every slot holds another adapter: loading it evicts one in use or recently used

A worker that reports no slots (an older worker) scores as one with a free slot, neither
preferred nor avoided. `gateway.routing.rank_workers` puts the workers within its load bound
that hold the adapter (1.0) first, then those loading it (0.6), then the rest in the
adapter's rendezvous order: a free slot (0.8) off the adapter's home does not outrank its
home, because an adapter loaded there takes a slot from that worker's own adapters and is
loaded home again once evicted.
"""

from __future__ import annotations

from runtime.registry import WorkerInfo

RESIDENT = 1.0
FREE_SLOT = 0.8
LOADING = 0.6
FULL = 0.0


def lora_affinity(worker: WorkerInfo, adapter_id: str) -> float:
    """The worker's score for a request on ``adapter_id`` (a content id)."""
    if adapter_id in worker.slot_adapters:
        return RESIDENT
    if not worker.slot_adapters and adapter_id in worker.adapters:
        return RESIDENT
    if not worker.slot_adapters or None in worker.slot_adapters:
        return FREE_SLOT
    if adapter_id in worker.loading_adapters:
        return LOADING
    return FULL
