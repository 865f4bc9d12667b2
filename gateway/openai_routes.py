"""The OpenAI-compatible API under /v1; completions, chat and responses are one call into
`gateway.pipeline`."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.deps import CurrentTenant, State
from gateway.errors import ModelNotFoundError
from gateway.pipeline import handle_request
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.resolution import list_models
from gateway.responses_api import ResponsesRequest
from gateway.tenancy.usage import day_range, read_usage

router = APIRouter(prefix="/v1")


@router.get("/models")
async def models(caller: CurrentTenant, state: State) -> dict[str, Any]:
    return await list_models(
        caller=caller, tenants=state.tenants, directory=state.workers, bases=state.bases
    )


@router.get("/models/{model:path}")
async def retrieve_model(model: str, caller: CurrentTenant, state: State) -> dict[str, Any]:
    """One entry of /v1/models (the SDK's `models.retrieve`); another tenant's adapter is as
    unknown as a missing one (404 model_not_found)."""
    listed = await models(caller, state)
    found = next((entry for entry in listed["data"] if entry["id"] == model), None)
    if found is None:
        raise ModelNotFoundError(model)
    return found


@router.post("/completions")
async def completions(
    body: CompletionRequest, caller: CurrentTenant, state: State, request: Request
) -> Response:
    return await handle_request(body, state=state, caller=caller, http=request)


@router.post("/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, caller: CurrentTenant, state: State, request: Request
) -> Response:
    return await handle_request(body, state=state, caller=caller, http=request)


@router.post("/responses")
async def responses(
    body: ResponsesRequest, caller: CurrentTenant, state: State, request: Request
) -> Response:
    return await handle_request(body, state=state, caller=caller, http=request)


@router.get("/usage")
async def usage(
    caller: CurrentTenant, state: State, start_date: str | None = None, end_date: str | None = None
) -> dict[str, Any]:
    """The caller's usage per day and model (dates are UTC, YYYY-MM-DD, default today)."""
    days = day_range(start_date, end_date, today=datetime.now(UTC).date())
    rows = await read_usage(
        state.redis, prefix=state.settings.key_prefix, tenants=[caller.tenant], days=days
    )
    return {"object": "list", "data": [{k: v for k, v in r.items() if k != "tenant"} for r in rows]}
