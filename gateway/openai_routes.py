"""The OpenAI-compatible API under /v1; each route is a few lines over `gateway.serving`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.deps import CurrentTenant, State
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.serving import list_models, serve_chat, serve_completion

router = APIRouter(prefix="/v1")


@router.get("/models")
async def models(caller: CurrentTenant, state: State) -> dict[str, Any]:
    return await list_models(state=state, caller=caller)


@router.post("/completions")
async def completions(
    body: CompletionRequest, caller: CurrentTenant, state: State, request: Request
) -> Response:
    return await serve_completion(body, state=state, caller=caller, request=request)


@router.post("/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, caller: CurrentTenant, state: State, request: Request
) -> Response:
    return await serve_chat(body, state=state, caller=caller, request=request)
