"""The logic behind /v1: list models, and serve one completion or chat request end to end."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse

from gateway import metrics
from gateway.admission import Admission
from gateway.errors import ClientDisconnectedError, InvalidRequestError, status_of
from gateway.generation import Tally, collect, generate_all, open_stream, stream_events
from gateway.interrupts import Interrupt
from gateway.jobs import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    Job,
    new_job,
    resolve_model,
    sampling_params,
    settle_max_tokens,
)
from gateway.metrics import RequestObservation
from gateway.openai_format import ChatFormat, CompletionFormat, Header, OutputFormat
from gateway.prompts import chat_prompt_ids, completion_prompt_ids
from gateway.protocol import ChatCompletionRequest, CompletionRequest, ShapeLimits
from gateway.state import GatewayState
from gateway.tenants import Caller
from gateway.usage import UsageDelta
from runtime.logs import REQUEST_ID

T = TypeVar("T")
# What proxies must not do to an event stream: cache it or buffer it.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
OVERHEAD_HEADER = "x-switchboard-overhead-ms"
# Non-streaming replies with more token entries (tokens and their top logprobs) than this
# are assembled and serialized on a thread, so a big n × logprobs answer stalls no stream.
INLINE_COLLECT_ENTRIES = 2048


async def list_models(*, state: GatewayState, caller: Caller) -> dict[str, Any]:
    """The base model, then the caller's own adapters (shaped like vLLM's LoRA entries)."""
    base_id = state.settings.served_model_name
    base = {
        "id": base_id,
        "object": "model",
        "created": 0,
        "owned_by": "switchboard",
        "root": base_id,
        "parent": None,
        "max_model_len": state.max_model_len,
    }
    adapters = [
        {
            "id": a.name,
            "object": "model",
            "created": a.created_at,
            "owned_by": caller.tenant,
            "root": a.adapter_id,
            "parent": base_id,
            "max_model_len": state.max_model_len,
        }
        for a in await state.tenants.list_adapters(caller.tenant)
    ]
    return {"object": "list", "data": [base, *adapters]}


async def serve_completion(
    body: CompletionRequest, *, state: GatewayState, caller: Caller, request: Request
) -> Response:
    tally = Tally(arrived=arrival_of(request))
    with _observed(caller, body.model, "completions", tally) as observation:
        body.check_supported()
        body.check_shape(ShapeLimits.of(state.settings))
        adapter = await _resolve(body.model, state=state, caller=caller)
        prompt_ids = await completion_prompt_ids(
            body, tokenizer=state.tokenizer, max_model_len=state.max_model_len
        )
        best_of = body.samples_to_generate if body.samples_to_generate > body.n else None
        return await _serve(
            body,
            adapter=adapter,
            prompt_ids=prompt_ids,
            requested_max_tokens=body.max_tokens,
            default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
            # best_of ranks samples by cumulative logprob: the worker must send them.
            logprobs=body.logprobs if body.logprobs is not None or not best_of else 0,
            best_of=best_of,
            id_prefix="cmpl",
            make_format=lambda job: CompletionFormat(_header(job), state.tokenizer, body.logprobs),
            state=state,
            caller=caller,
            request=request,
            tally=tally,
            observation=observation,
        )


async def serve_chat(
    body: ChatCompletionRequest, *, state: GatewayState, caller: Caller, request: Request
) -> Response:
    tally = Tally(arrived=arrival_of(request))
    with _observed(caller, body.model, "chat", tally) as observation:
        body.check_supported()
        body.check_shape(ShapeLimits.of(state.settings))
        adapter = await _resolve(body.model, state=state, caller=caller)
        prompt_ids = await chat_prompt_ids(
            body, tokenizer=state.tokenizer, max_model_len=state.max_model_len
        )
        return await _serve(
            body,
            adapter=adapter,
            prompt_ids=prompt_ids,
            requested_max_tokens=body.requested_max_tokens,
            default_max_tokens=None,  # the whole remaining context: chat answers end at EOS
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            id_prefix="chatcmpl",
            make_format=lambda job: ChatFormat(_header(job), state.tokenizer, body.logprobs),
            state=state,
            caller=caller,
            request=request,
            tally=tally,
            observation=observation,
        )


@contextlib.contextmanager
def _observed(
    caller: Caller, model: str, endpoint: str, tally: Tally
) -> Iterator[RequestObservation]:
    """Count the request once, with its final status: here if it fails before its response
    exists; for a response, when the response is over (see `_serve`)."""
    observation = RequestObservation(tenant=caller.tenant, model=model, endpoint=endpoint)
    try:
        yield observation
    except BaseException as exc:
        observation.finish(status_of(exc))
        raise


async def _resolve(model: str, *, state: GatewayState, caller: Caller):
    return await resolve_model(
        tenants=state.tenants,
        caller=caller,
        model=model,
        served_model_name=state.settings.served_model_name,
    )


async def _serve(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    adapter,
    prompt_ids: list[int],
    requested_max_tokens: int | None,
    default_max_tokens: int | None,
    logprobs: int | None,
    id_prefix: str,
    make_format,
    state: GatewayState,
    caller: Caller,
    request: Request,
    tally: Tally,
    observation: RequestObservation,
    best_of: int | None = None,
) -> Response:
    """What completions and chat share once the prompt is tokens: budget, admission, job,
    response, and settlement of the quota reservation however the request ends."""
    max_tokens = settle_max_tokens(
        requested=requested_max_tokens,
        default=default_max_tokens,
        prompt_len=len(prompt_ids),
        max_model_len=state.max_model_len,
    )
    max_tokens = bound_generated_tokens(
        max_tokens,
        samples=best_of or body.n,
        explicit=requested_max_tokens is not None,
        limit=state.settings.max_generated_tokens,
    )
    params = sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, n=best_of)
    weight = await state.scheduling.weight(caller.tenant)  # cached: no Redis trip as a rule
    job = new_job(
        body,
        id_prefix=id_prefix,
        caller=caller,
        prompt_ids=prompt_ids,
        params=params,
        adapter=adapter,
        timeout_s=state.settings.request_timeout_s,
        keep=body.n if best_of else None,
        tenant_weight=weight,
    )
    REQUEST_ID.set(job.request_id)  # every log line of this request carries it from here
    admission = Admission(
        state.quotas,
        caller.tenant,
        request_id=job.request_id,
        tokens=job.reserved_tokens,
    )

    async def settle() -> None:
        observation.finish(tally.status)
        used = (len(prompt_ids) if tally.started else 0) + tally.completion_tokens
        if tally.grant is not None:  # its worker slot: to the next request in fair order
            state.fair_queue.release(tally.grant, used_tokens=used)
        if admission.reservation is None:
            return  # refused, or never decided: nothing reserved
        usage = UsageDelta(
            model=job.model,
            prompt_tokens=len(prompt_ids) if tally.started else 0,
            completion_tokens=tally.completion_tokens,
            cached_tokens=tally.cached_tokens,
        )
        # Shielded: a cancelled request (server shutdown) still gives its slot back.
        reservation = admission.reservation
        await asyncio.shield(state.quotas.settle(reservation, used_tokens=used, usage=usage))

    try:
        return await respond(
            job, fmt=make_format(job), stream=body.stream, include_usage=body.include_usage,
            state=state, request=request, tally=tally, admission=admission, on_close=settle,
        )  # fmt: skip
    except BaseException as exc:
        observation.finish(status_of(exc))
        await settle()
        raise


def bound_generated_tokens(max_tokens: int, *, samples: int, explicit: bool, limit: int) -> int:
    """n (or best_of) × max_tokens within `max_generated_tokens`: an explicit max_tokens past
    it is a 400; a default one is cut to fit."""
    if samples * max_tokens <= limit:
        return max_tokens
    if explicit or samples > limit:
        raise InvalidRequestError(
            f"n × max_tokens may be at most {limit} tokens; this request asks for "
            f"{samples} × {max_tokens}",
            param="max_tokens" if explicit else "n",
        )
    return limit // samples


def arrival_of(request: Request) -> float:
    """When the request reached the app (``StampArrival``), else now."""
    return getattr(request.state, "arrived", None) or time.monotonic()


def _header(job: Job) -> Header:
    return Header(id=job.request_id, created=job.created, model=job.model)


class ClosingEventStream(EventSourceResponse):
    """An SSE response that runs `on_close` once it ends, however it ends (finished, client
    gone, error): the one place a streamed request's quota reservation is settled.

    Streams on two asyncio tasks (the events, and a watch for the client leaving) instead of
    Starlette's anyio task group, which cost ~0.3 ms per request here (cancel scopes and
    async-library detection on every call): that much of the gateway's added TTFT.
    """

    def __init__(self, events: AsyncGenerator[bytes], *, on_close, headers) -> None:
        super().__init__(events, headers=headers)
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await first_of(self.stream_response(send), self.listen_for_disconnect(receive))
        finally:
            # Closing the generator cancels the worker call (a client that left mid-stream
            # leaves it suspended); only then is the tally final.
            await self.events.aclose()
            await self.on_close()


async def respond(
    job: Job,
    *,
    fmt: OutputFormat,
    stream: bool,
    include_usage: bool,
    state: GatewayState,
    request: Request,
    tally: Tally,
    admission: Admission,
    on_close: Callable[[], Awaitable[None]],
) -> Response:
    """Once admitted, stream (after the first token is in) or collect; a client gone early
    cancels the call. `on_close` runs when the response is over (for a stream: when the
    stream ends)."""
    where = {
        "directory": state.workers,
        "channels": state.channels,
        "queue": state.fair_queue,
        "tally": tally,
    }
    if stream:
        admitted = admission.run(lambda: open_stream(job, **where))
        worker_stream = await until_disconnect(request, admitted)
        events = stream_events(
            worker_stream, job=job, fmt=fmt, include_usage=include_usage, tally=tally
        )
        headers = {**SSE_HEADERS, **admission.headers, **_overhead_header(tally)}
        return ClosingEventStream(events, on_close=on_close, headers=headers)

    reply = await until_disconnect(request, admission.run(lambda: generate_all(job, **where)))
    top = job.params.logprobs if job.params.HasField("logprobs") else 0
    entries = sum(len(m.token_ids) for m in reply.responses) * (1 + top)
    if entries <= INLINE_COLLECT_ENTRIES:
        body = collect(reply, job=job, fmt=fmt, tally=tally)
        await on_close()
        return JSONResponse(body, headers={**admission.headers, **_overhead_header(tally)})
    # Assembled and serialized on a thread; the tally is final once it is back.
    response = await asyncio.to_thread(_collected_response, reply, job, fmt, tally)
    await on_close()
    response.headers.update({**admission.headers, **_overhead_header(tally)})
    return response


def _collected_response(reply, job: Job, fmt: OutputFormat, tally: Tally) -> JSONResponse:
    return JSONResponse(collect(reply, job=job, fmt=fmt, tally=tally))


def _overhead_header(tally: Tally) -> dict[str, str]:
    """The gateway's own time on the request up to its response (for a stream: up to the
    first token's chunk), for clients and load tests to attribute latency exactly."""
    overhead = tally.overhead_s()
    metrics.REQUEST_OVERHEAD.observe(overhead)
    return {OVERHEAD_HEADER: f"{overhead * 1e3:.3f}"}


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run `work` unless the client disconnects first; then cancel it (which cancels the
    worker call) and raise ClientDisconnectedError.

    `work` runs in the caller's own task, which a watch for the disconnect interrupts: one
    task per request fewer than racing two (`first_of`), ~3% of the gateway's CPU under
    load."""
    watch = asyncio.ensure_future(_disconnected(request))
    gone = Interrupt(watch, lambda watched: watched.exception() is None)
    try:
        with gone:
            return await work
    except asyncio.CancelledError:
        if not gone.fired:
            raise
        raise ClientDisconnectedError("the client closed the connection") from None
    finally:
        watch.cancel()


async def first_of(
    work: Coroutine[Any, Any, T], watch: Coroutine[Any, Any, None]
) -> asyncio.Future[T]:
    """Run `work` until it ends or `watch` returns, whichever is first; the other is
    cancelled. Returns `work`'s task, done or cancelled; `work`'s exception propagates."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(watch)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()
    return task


async def _disconnected(request: Request) -> None:
    # The body has been read already, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
