"""One completion or chat request, from its route to a worker and back, as one pipeline:

    authorize → parse → resolve → admit → route → relay → settle

Authorization is the route's dependency (`deps.CurrentTenant`: API key → tenant), which
FastAPI solves before it validates the body. Each later stage lives in the module named for
it (`parsing`, `resolution`, `admission`, `routing`, `relay`, `settlement`), and this module
is the only place that calls them, in that order: `handle_request` for an HTTP request,
`resolve_line` and `answer_line` for a batch line (`gateway.batch`), which has no HTTP around
it and is admitted and billed by its batch; what they pass along is a `gateway.job.Job` and a
`gateway.tally.Tally`. Admission may decide beside the worker call
(`gateway.admission`), so it wraps route and relay until the worker's first answer. The HTTP
plumbing around them (arrival, the client leaving, the SSE response) is `gateway.connection`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gateway import metrics, relay, routing
from gateway.admission import Admission
from gateway.connection import SSE_HEADERS, ClosingEventStream, arrival_of, until_disconnect
from gateway.errors import status_of
from gateway.fleet.bases import ServedBase
from gateway.job import Job
from gateway.large_bodies import large_json_response
from gateway.metrics import RequestObservation
from gateway.openai_format import ChatFormat, Header, OutputFormat, output_format
from gateway.parsing import OpenAIRequest, parse
from gateway.protocol import ShapeLimits
from gateway.resolution import ModelLimits, resolve, resolve_target
from gateway.responses_api import ResponsesRequest
from gateway.responses_format import ResponsesFormat
from gateway.settlement import settle
from gateway.state import GatewayState
from gateway.tally import Tally
from gateway.tenancy.tenants import Caller
from gateway.tokenizer import ChatTokenizer
from gateway.worker_client import WorkerReply
from rpc import worker_pb2
from runtime.logs import REQUEST_ID

T = TypeVar("T")
OVERHEAD_HEADER = "x-switchboard-overhead-ms"
# Non-streaming replies with more token entries (tokens and their top logprobs) than this
# are assembled and serialized on a thread, so a big n × logprobs answer stalls no stream.
INLINE_COLLECT_ENTRIES = 2048


async def handle_request(
    body: OpenAIRequest, *, state: GatewayState, caller: Caller, http: Request
) -> Response:
    """The response to one request; the request is settled however it ends (a stream: when
    the stream ends) and counted once, with its final status."""
    tally = Tally(arrived=arrival_of(http))
    observation = RequestObservation(tenant=caller.tenant, model=body.model, endpoint=body.endpoint)
    close: Callable[[], Awaitable[None]] | None = None
    try:
        job, base = await _resolved(body, state=state, caller=caller, raw=await http.body())
        REQUEST_ID.set(job.request_id)  # every log line of this request carries it from here
        admission = Admission(
            state.quotas, job.tenant, request_id=job.request_id, tokens=job.reserved_tokens
        )
        close = _settlement(job, tally, admission, observation, state)
        header = Header(job.request_id, job.created, job.model)
        fmt = _output_format(body, header, base.tokenizer, job.prompt_ids)
        if body.stream:
            stream = await until_disconnect(
                http, admission.run(lambda: _route_and_relay(relay.open_stream, job, state, tally))
            )
            events = relay.stream_events(
                stream, job=job, fmt=fmt, include_usage=body.include_usage, tally=tally
            )
            headers = {**SSE_HEADERS, **admission.headers, **_overhead_header(tally)}
            return ClosingEventStream(events, on_close=close, headers=headers)
        reply = await until_disconnect(
            http, admission.run(lambda: _route_and_relay(relay.fetch_reply, job, state, tally))
        )
        response = await _collected(reply, job=job, fmt=fmt, tally=tally)
        await close()
        response.headers.update({**admission.headers, **_overhead_header(tally)})
        return response
    except BaseException as exc:
        observation.finish(status_of(exc))
        if close is not None:
            await close()
        raise


async def resolve_line(body: OpenAIRequest, *, state: GatewayState, caller: Caller) -> Job:
    """A batch line (`gateway.batch.runner`), parsed and resolved as an HTTP request is, in
    the batch band. Raises what the HTTP request would have answered."""
    job, _ = await _resolved(body, state=state, caller=caller, raw=None)
    return dataclasses.replace(job, priority=worker_pb2.PRIORITY_BATCH)


async def answer_line(body: OpenAIRequest, job: Job, *, state: GatewayState, tally: Tally) -> dict:
    """A resolved batch line through the rest of the stages, without HTTP: route → relay →
    settle, its whole answer's body. Its quota admission is the batch's own: a line is billed
    once, in the same atomic step that records its result, from ``tally`` (which the caller
    reads however the line ends, a cancelled one too: the worker reports what it generated)."""
    observation = RequestObservation(tenant=job.tenant, model=body.model, endpoint=body.endpoint)
    unmetered = Admission(state.quotas, job.tenant, request_id=job.request_id, tokens=0)
    close = _settlement(job, tally, unmetered, observation, state)
    try:
        header = Header(job.request_id, job.created, job.model)
        base = state.bases.last_served(job.base) or state.bases.default  # as resolved
        fmt = _output_format(body, header, base.tokenizer, job.prompt_ids)
        reply = await _route_and_relay(relay.fetch_reply, job, state, tally)
        collect = functools.partial(relay.collect, reply, job=job, fmt=fmt, tally=tally)
        if _entries(reply, job) <= INLINE_COLLECT_ENTRIES:  # a small answer: no thread hop
            answer = collect()
        else:
            answer = await asyncio.to_thread(collect)
        await close()
        return answer
    except BaseException as exc:
        observation.finish(status_of(exc))
        await close()
        raise


async def _resolved(
    body: OpenAIRequest, *, state: GatewayState, caller: Caller, raw: bytes | None
) -> tuple[Job, ServedBase]:
    """parse → resolve: the job, and the base it runs on."""
    parsed = parse(body, limits=ShapeLimits.of(state.settings), raw=raw)
    target = await resolve_target(
        model=body.model,
        caller=caller,
        tenants=state.tenants,
        directory=state.workers,
        bases=state.bases,
    )
    base = target.base
    job = await resolve(
        parsed,
        caller=caller,
        tenants=state.tenants,
        grammars=state.grammars,
        tokenizer=base.tokenizer,
        weights=state.weights,
        limits=ModelLimits.of(state.settings, max_model_len=base.max_model_len, base=base.name),
        target=target,
    )
    return job, base


def _settlement(
    job: Job, tally: Tally, admission: Admission, observation: RequestObservation,
    state: GatewayState,
) -> Callable[[], Awaitable[None]]:  # fmt: skip
    """settle, bound to the request: however it ends, once."""
    return functools.partial(
        settle, job, tally, admission=admission, observation=observation,
        queue=state.fair_queue, quotas=state.quotas,
    )  # fmt: skip


async def _route_and_relay(
    call: Callable[..., Awaitable[T]], job: Job, state: GatewayState, tally: Tally
) -> T:
    """route → relay: a slot on the best worker, then ``call`` on the route's workers."""
    route = await routing.route(job, directory=state.workers, queue=state.fair_queue)
    tally.grant = route.grant  # released by `settle`, however the request ends
    return await call(job, route, channels=state.channels, tally=tally)


async def _collected(reply: WorkerReply, *, job: Job, fmt: OutputFormat, tally: Tally) -> Response:
    """The whole body: once large, assembled on a thread and serialized in pieces that leave
    the loop free (``gateway.large_bodies``); the tally is final once it is back."""
    if _entries(reply, job) <= INLINE_COLLECT_ENTRIES:
        return JSONResponse(relay.collect(reply, job=job, fmt=fmt, tally=tally))
    return await large_json_response(
        functools.partial(relay.collect, reply, job=job, fmt=fmt, tally=tally)
    )


def _entries(reply: WorkerReply, job: Job) -> int:
    """Token entries in a whole answer (tokens and their top logprobs): its assembly's size."""
    top = job.params.logprobs if job.params.HasField("logprobs") else 0
    return sum(len(m.token_ids) + len(m.prompt_logprobs) for m in reply.responses) * (1 + top)


def _output_format(
    body: OpenAIRequest, header: Header, tokenizer: ChatTokenizer, prompt_ids: list[int]
) -> OutputFormat:
    """The endpoint's format: a Responses request's answer is read as chat's, then shaped."""
    if isinstance(body, ResponsesRequest):
        chat = ChatFormat(header, tokenizer, False, tool_calls=body.chat.calls_tools)
        return ResponsesFormat(header, chat, body)
    return output_format(body, header, tokenizer, prompt_ids=prompt_ids)


def _overhead_header(tally: Tally) -> dict[str, str]:
    """The gateway's own time on the request up to its response (for a stream: up to the
    first token's chunk), for clients and load tests to attribute latency exactly."""
    overhead = tally.overhead_s()
    metrics.REQUEST_OVERHEAD.observe(overhead)
    return {OVERHEAD_HEADER: f"{overhead * 1e3:.3f}"}
