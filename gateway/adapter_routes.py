"""Tenants manage their own adapters under /v1/adapters; names are scoped to the tenant.

Another tenant's adapter is answered exactly like one that does not exist (same 404, same
message), so a tenant can never learn that a name is used elsewhere.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from gateway.deps import CurrentTenant, State
from gateway.state import GatewayState
from gateway.tenancy.tenants import TenantAdapter
from gateway.uploads.catalog import adapter_not_found
from gateway.uploads.registration import delete_adapter, upload_adapter

router = APIRouter(prefix="/v1/adapters")


def adapter_object(record: TenantAdapter, *, base_model: str) -> dict[str, Any]:
    return {
        "id": record.name,
        "object": "adapter",
        "name": record.name,
        "adapter_id": record.adapter_id,
        "base_model": base_model,
        "created_at": record.created_at,
        "updated_at": record.updated_at or record.created_at,
        "version": record.current_version,
        "rank": record.rank,
        "target_modules": record.target_modules,
        "num_bytes": record.num_bytes,
    }


def _base(record: TenantAdapter, state: GatewayState) -> str:
    """The base an adapter is bound to (records from before bases were named: the default)."""
    return record.base or state.bases.default.name


@router.post("", status_code=201)
async def create(
    request: Request, response: Response, caller: CurrentTenant, state: State
) -> dict[str, Any]:
    """Multipart: `name` plus a `file` archive, or `adapter_config` and `adapter_model`.
    201 with the new record; 200 with the existing one when the name already holds this
    very content (an upload retried); 409 when it holds other content."""
    registration = await upload_adapter(request, state=state, tenant=caller.tenant)
    if not registration.created:
        response.status_code = 200
    return adapter_object(registration.record, base_model=_base(registration.record, state))


@router.get("")
async def list_(caller: CurrentTenant, state: State) -> dict[str, Any]:
    records = await state.tenants.list_adapters(caller.tenant)
    return {
        "object": "list",
        "data": [adapter_object(r, base_model=_base(r, state)) for r in records],
    }


@router.get("/{name:path}")
async def get(name: str, caller: CurrentTenant, state: State) -> dict[str, Any]:
    record = await state.tenants.get_adapter(caller.tenant, name)
    if record is None:
        raise adapter_not_found(name)
    return adapter_object(record, base_model=_base(record, state))


@router.delete("/{name:path}")
async def delete(name: str, caller: CurrentTenant, state: State) -> dict[str, Any]:
    await delete_adapter(state=state, tenant=caller.tenant, name=name)
    return {"id": name, "object": "adapter", "deleted": True}
