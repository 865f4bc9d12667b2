"""A tenant's own account under /v1/account: its keys (ids, never secrets), its limits beside
what of each is in use now, and its scheduling share; creating and revoking its own keys where
the admin allows it (`PUT /admin/tenants/{tenant}/self-service`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter

from gateway.deps import CurrentTenant, State
from gateway.errors import PermissionDeniedError
from gateway.state import GatewayState
from gateway.tenancy.tenants import Caller

router = APIRouter(prefix="/v1")


@router.get("/account")
async def account(caller: CurrentTenant, state: State) -> dict[str, Any]:
    """`limits` and `in_use` share their keys; a limit of null is none (and its use is not
    counted). Adapter limits left unset show the gateway's defaults, which then apply."""
    quota = await state.quotas.get_quota(caller.tenant)
    use = await state.quotas.usage_now(caller.tenant)
    adapters = await state.tenants.list_adapters(caller.tenant)
    settings = state.settings
    limits = asdict(quota)
    if quota.max_adapters is None:
        limits["max_adapters"] = settings.default_max_adapters
    if quota.max_adapter_bytes is None:
        limits["max_adapter_bytes"] = settings.default_max_adapter_storage_bytes
    in_use = {
        **asdict(use),
        "max_adapters": len(adapters),
        "max_adapter_bytes": sum(a.num_bytes for a in adapters),
    }
    return {
        "object": "account",
        "tenant": caller.tenant,
        "key_id": caller.key_id,
        "keys": await state.tenants.list_keys(caller.tenant),
        "self_service_keys": await state.tenants.self_service_keys(caller.tenant),
        "limits": limits,
        "in_use": in_use,
        "scheduling": asdict(await state.weights.get(caller.tenant)),
    }


@router.post("/account/keys", status_code=201)
async def create_key(caller: CurrentTenant, state: State) -> dict[str, Any]:
    """A new key for the caller's tenant: in this response only."""
    await _require_self_service(caller, state)
    return asdict(await state.tenants.create_key(caller.tenant))


@router.delete("/account/keys/{key_id}")
async def revoke_key(key_id: str, caller: CurrentTenant, state: State) -> dict[str, Any]:
    """One of the tenant's own keys (the caller's too: that signs it out); another tenant's key
    answers 404, as a missing one."""
    await _require_self_service(caller, state)
    await state.tenants.revoke_key(key_id, tenant=caller.tenant)
    return {"key_id": key_id, "deleted": True}


async def _require_self_service(caller: Caller, state: GatewayState) -> None:
    if not await state.tenants.self_service_keys(caller.tenant):
        raise PermissionDeniedError(
            "your admin manages this tenant's keys (self-service keys are off)"
        )
