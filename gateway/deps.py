"""FastAPI dependencies, as `Annotated` aliases the routes take as parameters."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from gateway.errors import AdminAuthenticationError
from gateway.state import GatewayState
from gateway.tenancy.tenants import Caller


# Dependencies are `async def` even when they do not await: FastAPI runs a plain `def`
# dependency in a worker thread, a hand-off that cost more than the rest of admission.
async def get_state(request: Request) -> GatewayState:
    return request.app.state.gateway


State = Annotated[GatewayState, Depends(get_state)]


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def current_tenant(request: Request, state: State) -> Caller:
    return await state.tenants.authenticate(bearer_token(request))


CurrentTenant = Annotated[Caller, Depends(current_tenant)]


def check_admin_token(state: GatewayState, given: str | None) -> None:
    expected = state.settings.admin_token.get_secret_value().encode()
    # Constant-time; an empty configured token (dev mode) never matches anything.
    if not expected or not hmac.compare_digest((given or "").encode(), expected):
        raise AdminAuthenticationError("a valid admin token is required: Authorization: Bearer …")


async def require_admin(request: Request, state: State) -> None:
    check_admin_token(state, bearer_token(request))
