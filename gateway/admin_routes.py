"""The admin API under /admin (bearer admin token): tenants, API keys, adapters, quotas,
scheduling weights, usage, the live workers."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from gateway.deps import State, require_admin
from gateway.errors import InvalidRequestError
from gateway.fleet.pools import Pool
from gateway.state import GatewayState
from gateway.tenancy.quotas import Quota
from gateway.tenancy.usage import day_range, read_usage
from gateway.tenancy.weights import WeightAssignment
from gateway.uploads.registration import delete_adapter, register_adapter_dir
from gateway.worker_client import stats
from runtime.registry import WorkerInfo

log = logging.getLogger(__name__)
STATS_TIMEOUT_S = 2.0

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


class NewTenant(BaseModel):
    name: str


class QuotaBody(BaseModel):
    """A tenant's limits; a field left out or null is unlimited."""

    model_config = ConfigDict(extra="forbid")

    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    max_concurrent_requests: int | None = Field(default=None, ge=1)
    daily_tokens: int | None = Field(default=None, ge=1)
    # Adapter storage (float32 bytes of all the tenant's adapters); left out or null: the
    # gateway's defaults, not unlimited.
    max_adapters: int | None = Field(default=None, ge=0)
    max_adapter_bytes: int | None = Field(default=None, ge=0)


class SchedulingBody(BaseModel):
    """Exactly one of a tier (by name) or a weight of the tenant's own."""

    model_config = ConfigDict(extra="forbid")

    tier: str | None = None
    weight: float | None = None


class SelfServiceBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: bool  # the tenant may create and revoke its own keys


class NewAdapter(BaseModel):
    name: str
    path: str  # a PEFT adapter directory readable by the gateway


@router.post("/tenants", status_code=201)
async def create_tenant(body: NewTenant, state: State) -> dict[str, Any]:
    """A new tenant starts with `default_max_concurrent_requests` in its quota (if set), so
    no tenant is unbounded by omission; the quotas API changes it."""
    tenant = await state.tenants.create_tenant(body.name)
    limit = state.settings.default_max_concurrent_requests
    if limit:
        await state.quotas.set_quota(tenant.name, Quota(max_concurrent_requests=limit))
    return asdict(tenant)


@router.get("/tenants")
async def list_tenants(state: State) -> dict[str, Any]:
    return {"data": [asdict(t) for t in await state.tenants.list_tenants()]}


@router.post("/tenants/{tenant}/keys", status_code=201)
async def create_key(tenant: str, state: State) -> dict[str, Any]:
    """The key is in this response only; Redis keeps its hash."""
    return asdict(await state.tenants.create_key(tenant))


@router.get("/tenants/{tenant}/keys")
async def list_keys(tenant: str, state: State) -> dict[str, Any]:
    """Key ids and creation times; never the keys."""
    return {"data": await state.tenants.list_keys(tenant)}


@router.put("/tenants/{tenant}/self-service")
async def set_self_service(tenant: str, body: SelfServiceBody, state: State) -> dict[str, Any]:
    await state.tenants.set_self_service_keys(tenant, body.keys)
    return {"tenant": tenant, "keys": body.keys}


@router.get("/tenants/{tenant}/self-service")
async def get_self_service(tenant: str, state: State) -> dict[str, Any]:
    await state.tenants.require_tenant(tenant)
    return {"tenant": tenant, "keys": await state.tenants.self_service_keys(tenant)}


@router.delete("/keys/{key_id}")
async def revoke_key(key_id: str, state: State) -> dict[str, Any]:
    await state.tenants.revoke_key(key_id)
    return {"key_id": key_id, "deleted": True}


@router.post("/tenants/{tenant}/adapters", status_code=201)
async def add_adapter(tenant: str, body: NewAdapter, state: State) -> dict[str, Any]:
    await state.tenants.require_tenant(tenant)
    record = await register_adapter_dir(
        state=state, tenant=tenant, name=body.name, path=Path(body.path)
    )
    return asdict(record)


@router.get("/tenants/{tenant}/adapters")
async def list_adapters(tenant: str, state: State) -> dict[str, Any]:
    await state.tenants.require_tenant(tenant)
    adapters = await state.tenants.list_adapters(tenant)
    # A record stored before versions were counted is version 1, as the tenant API says.
    return {"data": [asdict(a) | {"version": a.current_version} for a in adapters]}


@router.delete("/tenants/{tenant}/adapters/{name:path}")
async def remove_adapter(tenant: str, name: str, state: State) -> dict[str, Any]:
    """Forget the tenant's name for it; the content goes when no name points at it."""
    await state.tenants.require_tenant(tenant)
    removal = await delete_adapter(state=state, tenant=tenant, name=name)
    return {"name": name, "deleted": True, "content_deleted": removal.last_reference}


@router.put("/tenants/{tenant}/quotas")
async def set_quotas(tenant: str, body: QuotaBody, state: State) -> dict[str, Any]:
    """Replace the tenant's limits (they apply to the next admission decision)."""
    await state.tenants.require_tenant(tenant)
    await state.quotas.set_quota(tenant, Quota(**body.model_dump()))
    return {"tenant": tenant, **asdict(await state.quotas.get_quota(tenant))}


@router.get("/tenants/{tenant}/quotas")
async def get_quotas(tenant: str, state: State) -> dict[str, Any]:
    await state.tenants.require_tenant(tenant)
    return {"tenant": tenant, **asdict(await state.quotas.get_quota(tenant))}


@router.get("/tenants/{tenant}/quotas/in-use")
async def get_quotas_in_use(tenant: str, state: State) -> dict[str, Any]:
    """What of each per-minute, concurrency and daily limit is in use now (null: no limit)."""
    await state.tenants.require_tenant(tenant)
    return {"tenant": tenant, **asdict(await state.quotas.usage_now(tenant))}


@router.put("/tenants/{tenant}/scheduling")
async def set_scheduling(tenant: str, body: SchedulingBody, state: State) -> dict[str, Any]:
    """Put the tenant on a tier or give it a weight (its share of busy workers relative to
    other tenants'); this gateway applies it to the next request, others within
    `scheduling_cache_s`."""
    await state.tenants.require_tenant(tenant)
    if (body.tier is None) == (body.weight is None):
        raise InvalidRequestError(
            'give exactly one of "tier" (one of '
            f'{", ".join(sorted(state.weights.tiers))}) or "weight"',
            param="tier" if body.tier is not None else None,
        )
    if body.tier is not None:
        scheduling = await state.weights.set_tier(tenant, body.tier)
    else:
        scheduling = await state.weights.set_weight(tenant, body.weight)
    return _scheduling(tenant, scheduling)


@router.get("/tenants/{tenant}/scheduling")
async def get_scheduling(tenant: str, state: State) -> dict[str, Any]:
    await state.tenants.require_tenant(tenant)
    return _scheduling(tenant, await state.weights.get(tenant))


@router.delete("/tenants/{tenant}/scheduling")
async def reset_scheduling(tenant: str, state: State) -> dict[str, Any]:
    """Back to the default tier."""
    await state.tenants.require_tenant(tenant)
    return _scheduling(tenant, await state.weights.reset(tenant))


def _scheduling(tenant: str, scheduling: WeightAssignment) -> dict[str, Any]:
    return {"tenant": tenant, **asdict(scheduling)}


@router.get("/workers")
async def list_workers(state: State) -> dict[str, Any]:
    """Live workers (the registry), each with its base (its pool), its load, the adapters it
    has loaded, holds in its device slots and in its host cache, each content id named as
    "tenant/name" (none for content no name holds now, e.g. a replaced version still cached),
    and its engine's service per tenant (its `Stats`; null when the worker did not answer in
    time); and the pools, one per base, with their totals."""
    pools = await state.workers.pools()
    base_of = {w.worker_id: p.base for p in pools.values() for w in p.workers}
    workers = await state.workers.workers()
    held = sorted({a for w in workers for a in _content_ids(w)})
    names = await state.catalog.names_of(held)
    services = await asyncio.gather(*(_tenant_service(state, w.address) for w in workers))
    return {
        "data": [
            {
                **asdict(w),
                "base": base_of.get(w.worker_id, ""),
                "adapter_names": {a: names.get(a, []) for a in sorted(_content_ids(w))},
                "tenant_service": service,
            }
            for w, service in zip(workers, services, strict=True)
        ],
        "pools": [_pool_summary(p) for p in pools.values()],
    }


def _pool_summary(pool: Pool) -> dict[str, Any]:
    """One base's pool: its workers and their summed load and adapter slots."""
    return {
        "base": pool.base,
        "base_id": pool.base_id,
        "workers": [w.worker_id for w in pool.workers],
        "running": sum(w.running for w in pool.workers),
        "waiting": sum(w.waiting for w in pool.workers),
        "slots_used": sum(sum(a is not None for a in w.slot_adapters) for w in pool.workers),
        "slots_total": sum(w.max_loras for w in pool.workers),
    }


def _content_ids(worker: WorkerInfo) -> set[str]:
    return {*worker.adapters, *(a for a in worker.slot_adapters if a), *worker.host_adapters}


async def _tenant_service(state: GatewayState, address: str) -> list[dict[str, Any]] | None:
    try:
        answer = await stats(state.channels, address=address, timeout_s=STATS_TIMEOUT_S)
    except grpc.RpcError as exc:
        log.warning("Stats from worker %s failed: %s", address, exc)
        return None
    return [
        {
            "tenant": t.tenant,
            "weight": t.weight,
            "virtual_counter": t.virtual_counter,
            "prefill_tokens": t.prefill_tokens,
            "decode_tokens": t.decode_tokens,
            "mean_queue_s": t.queue_time_sum_s / t.queued_requests if t.queued_requests else 0.0,
        }
        for t in answer.tenants
    ]


@router.get("/usage")
async def usage(
    state: State,
    start_date: str | None = None,
    end_date: str | None = None,
    tenant: str | None = None,
) -> dict[str, Any]:
    """Usage across tenants (or one), per tenant, day and model."""
    if tenant is not None:
        await state.tenants.require_tenant(tenant)
        tenants = [tenant]
    else:
        tenants = [t.name for t in await state.tenants.list_tenants()]
    days = day_range(start_date, end_date, today=datetime.now(UTC).date())
    rows = await read_usage(
        state.redis, prefix=state.settings.key_prefix, tenants=tenants, days=days
    )
    return {"object": "list", "data": rows}
