"""The ``Worker`` gRPC service (proto/rpc/worker.proto) over an ``AsyncEngine``: messages in
and out, and the one mapping from engine and adapter errors to gRPC status codes.

The handlers only translate, enqueue, stream and abort; the engine steps elsewhere
(``AsyncEngine``), and ``worker.serving.server`` owns the process around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc

from adapters.errors import AdapterError, AdapterNotFoundError
from adapters.identity import check_adapter_id
from adapters.stores import AdapterStore, FilesystemAdapterStore
from rpc import worker_pb2, worker_pb2_grpc
from runtime.logs import REQUEST_ID
from worker.core.sequence import Band
from worker.errors import InvalidRequestError, TensorParallelError, UnknownAdapterError
from worker.sampling.sampling_params import SamplingParams
from worker.sampling.structured_output import StructuredOutput
from worker.serving.async_engine import AsyncEngine, SampleOutput
from worker.serving.engine_loop import EngineStoppedError
from worker.serving.metrics import WorkerMetrics

logger = logging.getLogger(__name__)


def band_of(priority: int) -> Band:
    """The request's band; a value this worker does not know is refused (proto3 enums are
    open: any number arrives)."""
    try:
        return Band(priority)
    except ValueError:
        raise InvalidRequestError(f"unknown priority {priority}") from None


def sampling_params_from_proto(msg: worker_pb2.SamplingParams) -> SamplingParams:
    """The engine's params from the wire's; raises ``InvalidRequestError``.

    proto3 cannot tell 0 from unset, so the two fields where 0 is meaningless anyway read 0
    as "unset": ``top_p`` (→ 1.0) and ``repetition_penalty`` (→ 1.0). ``temperature`` 0 is
    greedy and ``max_tokens`` 0 is an error, as in the engine.
    """
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        repetition_penalty=msg.repetition_penalty or 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        skip_special_tokens=msg.skip_special_tokens,
        num_speculative_tokens=msg.num_speculative_tokens
        if msg.HasField("num_speculative_tokens")
        else None,
        logit_bias=dict(msg.logit_bias) or None,
        structured_output=StructuredOutput(msg.structured_output.format, msg.structured_output.text)
        if msg.HasField("structured_output")
        else None,
    )


def response_from_sample(
    sample: SampleOutput, *, with_prompt_logprobs: bool = False, whole: bool = False
) -> worker_pb2.GenerateResponse:
    """One delta; ``with_prompt_logprobs``: the prompt's logprobs too, once they are all
    computed (the first sample to have them sends them, once). ``whole``: the sample's
    tokens, text and logprobs so far instead of this step's (a final output: its answer)."""
    out = sample.output
    response = worker_pb2.GenerateResponse(
        index=sample.index,
        token_ids=out.token_ids if whole else out.new_token_ids,
        text=out.text if whole else out.new_text,
        finish_reason=out.finish_reason or "",
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=out.num_tokens,
        cached_tokens=out.num_cached_tokens,
    )
    for token in (out.logprobs if whole else out.new_logprobs) or ():
        _add_logprob(response.logprobs, token)
    prompt = out.prompt_logprobs
    if with_prompt_logprobs and prompt and all(token is not None for token in prompt):
        for token in prompt:
            _add_logprob(response.prompt_logprobs, token)
    if isinstance(out.stop_reason, str):
        response.stop_string = out.stop_reason
    elif out.stop_reason is not None:
        response.stop_token_id = out.stop_reason
    return response


def _add_logprob(entries, token) -> None:
    entries.add(
        token_id=token.token_id,
        logprob=token.logprob or 0.0,
        top=[worker_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in token.top_logprobs or ()],
    )


def status_for(exc: Exception) -> grpc.StatusCode:
    """The one place engine and adapter errors become gRPC status codes.

    UNAVAILABLE is the only code that blames the worker (the gateway then tries another):
    a stopped engine, or a tensor-parallel group that lost a rank;
    INTERNAL is a request that failed alone (``SequenceFailedError``, or a bug it hit): the
    gateway neither retries it nor marks the worker failed. A request whose logits the
    model could not give (``NonFiniteLogitsError``) is INVALID_ARGUMENT, like bad values.
    """
    if isinstance(exc, UnknownAdapterError | AdapterNotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, InvalidRequestError | AdapterError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, EngineStoppedError | TensorParallelError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """The ``Worker`` service over an ``AsyncEngine`` (None until the model has loaded)."""

    def __init__(
        self,
        *,
        model_name: str,
        metrics: WorkerMetrics,
        adapter_store: AdapterStore | Path | None = None,
        base_id: str = "",
    ) -> None:
        self.model_name = model_name
        self.base_id = base_id  # the base's content id (runtime.bases)
        self.metrics = metrics
        # The store the gateway writes validated adapters to: requests name adapters by
        # content id, and the worker reads them only from here, never from a caller's path.
        self.adapter_store: AdapterStore | None = (
            FilesystemAdapterStore(adapter_store)
            if isinstance(adapter_store, Path)
            else adapter_store
        )
        self.engine: AsyncEngine | None = None
        self.draining = False
        self.on_adapters_changed: Callable[[], None] = lambda: None
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def wait_idle(self) -> None:
        """Until no Generate call is open."""
        await self._idle.wait()

    async def Generate(self, request, context):
        async for response, _ in self._generate(request, context):
            yield response

    async def GenerateAll(self, request, context):
        """The whole answer in one message a sample: each sample's final output, whole (the
        engine wakes this call once a sample, not once a step)."""
        responses, first_token_at = [], None
        # Closed at once when the call is cancelled (the request is aborted then), not
        # whenever the garbage collector finalizes the generator.
        async with contextlib.aclosing(self._generate(request, context, whole=True)) as finals:
            async for response, sample in finals:
                responses.append(response)
                times = sample.output.token_times[:1]
                if times and (first_token_at is None or times[0] < first_token_at):
                    first_token_at = times[0]
        return worker_pb2.GenerateAllResponse(
            responses=responses,
            first_token_to_end_s=(
                time.monotonic() - first_token_at if first_token_at is not None else 0.0
            ),
        )

    async def _generate(self, request, context, *, whole: bool = False):
        """One request's responses, each with the sample it came from, for either RPC:
        deltas, or (``whole``) each sample's whole answer once; errors abort the call with
        their code."""
        engine = await self._engine_or_abort(context)
        try:
            params = sampling_params_from_proto(request.params)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._in_flight += 1
        self._idle.clear()
        outcome = "cancelled"  # unless the stream ends or fails
        token = REQUEST_ID.set(request.request_id or "-")
        tokens = 0
        try:
            mix = [(part.adapter_id, part.weight) for part in request.adapter_mix] or None
            if mix is not None and request.adapter_id:
                raise InvalidRequestError("a request names adapter_id or adapter_mix, not both")
            needed = [request.adapter_id] if request.adapter_id else [i for i, _ in mix or []]
            for adapter_id in needed:
                if adapter_id not in engine.stats.adapter_ids:
                    await self._load_adapter(engine, adapter_id, await self._stored(adapter_id))
            samples = engine.generate(
                request.request_id or uuid.uuid4().hex,
                list(request.prompt_token_ids),
                params,
                adapter_id=request.adapter_id or None,
                mix=mix,
                n=request.params.n or 1,
                tenant=request.tenant or None,
                tenant_weight=request.tenant_weight or 1.0,
                band=band_of(request.priority),
                final_only=whole,
            )
            prompt_logprobs_due = params.prompt_logprobs is not None
            async with contextlib.aclosing(samples):
                async for sample in samples:
                    response = response_from_sample(
                        sample, with_prompt_logprobs=prompt_logprobs_due, whole=whole
                    )
                    prompt_logprobs_due = prompt_logprobs_due and not response.prompt_logprobs
                    tokens += len(response.token_ids)
                    self.metrics.generated_tokens.inc(len(response.token_ids))
                    yield response, sample
            outcome = "ok"
        except Exception as exc:
            outcome = status_for(exc).name
            await self._abort_with(context, exc)
        finally:
            self.metrics.requests.labels(outcome).inc()
            logger.info(
                "generate %s: %d prompt tokens, %d generated, adapter %s",
                outcome, len(request.prompt_token_ids), tokens,
                request.adapter_id or ("mix" if request.adapter_mix else "-"),
            )  # fmt: skip
            REQUEST_ID.reset(token)
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def LoadAdapter(self, request, context):
        engine = await self._engine_or_abort(context)
        if not request.adapter_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "adapter_id is required")
        try:
            if request.adapter_id not in engine.stats.adapter_ids:
                path = await self._stored(request.adapter_id)
                await self._load_adapter(engine, request.adapter_id, path)
        except Exception as exc:
            await self._abort_with(context, exc)
        return worker_pb2.LoadAdapterResponse(adapter_id=request.adapter_id)

    async def _load_adapter(self, engine: AsyncEngine, adapter_id: str, path: Path | str) -> None:
        """Load (timed and counted), then tell the registry now rather than at the next beat."""
        started = time.monotonic()
        try:
            await engine.load_adapter(adapter_id, path)
        except Exception:
            self.metrics.adapter_loads.labels("failed").inc()
            raise
        self.metrics.adapter_loads.labels("ok").inc()
        self.metrics.adapter_load_seconds.observe(time.monotonic() - started)
        self.on_adapters_changed()

    async def UnloadAdapter(self, request, context):
        engine = await self._engine_or_abort(context)
        try:
            await engine.unload_adapter(request.adapter_id)
        except Exception as exc:
            await self._abort_with(context, exc)
        self.metrics.adapter_unloads.inc()
        self.on_adapters_changed()
        return worker_pb2.UnloadAdapterResponse()

    async def Abort(self, request, context):
        """Stop a request and say what it cost (the gateway charges it when its client left);
        only the request's own tenant finds it."""
        engine = await self._engine_or_abort(context, refuse_while_draining=False)
        try:
            cost = await engine.abort_counted(request.request_id, tenant=request.tenant or None)
        except Exception as exc:
            await self._abort_with(context, exc)
        if cost is None:
            return worker_pb2.AbortResponse(found=False)
        return worker_pb2.AbortResponse(
            found=True,
            prompt_tokens=cost.prompt_tokens,
            completion_tokens=cost.completion_tokens,
            cached_tokens=cost.cached_tokens,
        )

    async def Stats(self, request, context):
        engine = await self._engine_or_abort(context, refuse_while_draining=False)
        stats = engine.stats
        return worker_pb2.StatsResponse(
            model=self.model_name,
            base_id=self.base_id,
            running=stats.running,
            waiting=stats.waiting,
            free_kv_blocks=stats.free_kv_blocks,
            total_kv_blocks=stats.total_kv_blocks,
            adapters_loaded=len(stats.adapter_ids),
            tenants=[
                worker_pb2.TenantService(
                    tenant=t.tenant,
                    weight=t.weight,
                    virtual_counter=t.counter,
                    prefill_tokens=t.prefill_tokens,
                    decode_tokens=t.decode_tokens,
                    queue_time_sum_s=t.queue_time_sum,
                    queued_requests=t.queue_time_buckets[-1] if t.queue_time_buckets else 0,
                )
                for t in stats.tenants
            ],
        )

    async def _stored(self, adapter_id: str) -> Path:
        """The adapter's local directory, from the store (an object store's blob is fetched
        into the worker's cache first, on a thread); AdapterNotFoundError if it is not there."""
        if self.adapter_store is None:
            raise UnknownAdapterError(
                f"adapter {adapter_id!r} is not loaded and this worker has no adapter store"
            )
        return await asyncio.to_thread(self.adapter_store.get, check_adapter_id(adapter_id))

    async def _engine_or_abort(self, context, *, refuse_while_draining: bool = True):
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        if self.draining and refuse_while_draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this worker is shutting down")
        return self.engine

    async def _abort_with(self, context, exc: Exception):
        code = status_for(exc)
        if code is grpc.StatusCode.INTERNAL:
            logger.exception("unexpected error in a worker call", exc_info=exc)
        await context.abort(code, str(exc) or type(exc).__name__)
