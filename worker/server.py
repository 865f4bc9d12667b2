"""The worker's gRPC server: ``Worker`` (proto/rpc/worker.proto) and ``grpc.health.v1``.

One process serves one engine. The engine runs in its own thread (``AsyncEngine``); the
handlers here only translate messages, enqueue, stream and abort. The worker publishes
itself to the Redis registry every heartbeat, and on SIGTERM/SIGINT it drains: health goes
NOT_SERVING, it leaves the registry, new Generate calls get UNAVAILABLE, running ones finish
(up to a deadline, after which they are aborted), then it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from adapters.errors import AdapterError, AdapterNotFoundError
from adapters.identity import check_adapter_id
from rpc import worker_pb2, worker_pb2_grpc
from switchboard import registry
from switchboard.logs import REQUEST_ID
from worker.async_engine import AsyncEngine, EngineStoppedError, SampleOutput
from worker.engine import LLMEngine
from worker.errors import InvalidRequestError
from worker.lora_manager import UnknownAdapterError
from worker.main_thread import STOP_SIGNALS, MainThreadEngineLoop
from worker.metrics import WorkerMetrics
from worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
DEFAULT_DRAIN_TIMEOUT_S = 30.0
Status = health_pb2.HealthCheckResponse.ServingStatus


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
        skip_special_tokens=msg.skip_special_tokens,
    )


def response_from_sample(sample: SampleOutput) -> worker_pb2.GenerateResponse:
    out = sample.output
    new = out.new_token_ids
    response = worker_pb2.GenerateResponse(
        index=sample.index,
        token_ids=new,
        text=out.new_text,
        finish_reason=out.finish_reason or "",
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=len(out.token_ids),
        cached_tokens=out.num_cached_tokens,
    )
    if out.logprobs is not None and new:
        for token in out.logprobs[-len(new) :]:
            response.logprobs.add(
                token_id=token.token_id,
                logprob=token.logprob or 0.0,
                top=[
                    worker_pb2.TopLogprob(token_id=t, logprob=lp)
                    for t, lp in token.top_logprobs or ()
                ],
            )
    if isinstance(out.stop_reason, str):
        response.stop_string = out.stop_reason
    elif out.stop_reason is not None:
        response.stop_token_id = out.stop_reason
    return response


def status_for(exc: Exception) -> grpc.StatusCode:
    """The one place engine and adapter errors become gRPC status codes."""
    if isinstance(exc, UnknownAdapterError | AdapterNotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, InvalidRequestError | AdapterError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, EngineStoppedError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """The ``Worker`` service over an ``AsyncEngine`` (None until the model has loaded)."""

    def __init__(
        self, *, model_name: str, metrics: WorkerMetrics, adapter_store: Path | None = None
    ) -> None:
        self.model_name = model_name
        self.metrics = metrics
        # The store the gateway writes validated adapters to: requests name adapters by
        # content id, and the worker reads them from here (`adapter_path` overrides it).
        self.adapter_store = adapter_store
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
            if request.adapter_id and request.adapter_id not in engine.stats.adapter_ids:
                path = request.adapter_path or self._stored(request.adapter_id)
                await self._load_adapter(engine, request.adapter_id, path)
            samples = engine.generate(
                request.request_id or uuid.uuid4().hex,
                list(request.prompt_token_ids),
                params,
                adapter_id=request.adapter_id or None,
                n=request.params.n or 1,
                tenant=request.tenant or None,
            )
            async with contextlib.aclosing(samples):
                async for sample in samples:
                    response = response_from_sample(sample)
                    tokens += len(response.token_ids)
                    self.metrics.generated_tokens.inc(len(response.token_ids))
                    yield response
            outcome = "ok"
        except Exception as exc:
            outcome = status_for(exc).name
            await self._abort_with(context, exc)
        finally:
            self.metrics.requests.labels(outcome).inc()
            logger.info(
                "generate %s: %d prompt tokens, %d generated, adapter %s",
                outcome, len(request.prompt_token_ids), tokens, request.adapter_id or "-",
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
            if request.adapter_id not in engine.stats.adapter_ids or request.path:
                path = request.path or self._stored(request.adapter_id)
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

    async def Stats(self, request, context):
        engine = await self._engine_or_abort(context, refuse_while_draining=False)
        stats = engine.stats
        return worker_pb2.StatsResponse(
            model=self.model_name,
            running=stats.running,
            waiting=stats.waiting,
            free_kv_blocks=stats.free_kv_blocks,
            total_kv_blocks=stats.total_kv_blocks,
            adapter_ids=stats.adapter_ids,
        )

    def _stored(self, adapter_id: str) -> Path:
        """The adapter's directory in the store; AdapterNotFoundError if it is not there."""
        if self.adapter_store is None:
            raise UnknownAdapterError(
                f"adapter {adapter_id!r} is not loaded and this worker has no adapter store"
            )
        path = self.adapter_store / check_adapter_id(adapter_id)
        if not path.is_dir():
            raise AdapterNotFoundError(f"adapter {adapter_id} is not in the store")
        return path

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


class WorkerServer:
    """The gRPC server, health service, engine loop and registry heartbeat of one worker."""

    def __init__(
        self,
        engine_factory: Callable[[], LLMEngine],
        *,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        worker_id: str | None = None,
        advertise_host: str | None = None,
        redis: Redis | None = None,
        redis_prefix: str = registry.DEFAULT_PREFIX,
        ttl: float = registry.DEFAULT_TTL_S,
        heartbeat_interval: float = registry.HEARTBEAT_INTERVAL_S,
        adapter_store: Path | None = None,
        engine_runner: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._engine_factory = engine_factory
        self._engine_runner = engine_runner  # see AsyncEngine.start
        self.model_name = model_name
        self.host = host
        self.port = port
        self.worker_id = worker_id
        self.advertise_host = advertise_host or _reachable_host(host)
        self.redis = redis
        self.redis_prefix = redis_prefix
        self.ttl = ttl
        self.heartbeat_interval = heartbeat_interval
        self.metrics = WorkerMetrics(lambda: self.engine.stats if self.engine else None)
        self.servicer = WorkerServicer(
            model_name=model_name, metrics=self.metrics, adapter_store=adapter_store
        )
        self.health = health_aio.HealthServicer()
        self.server = grpc.aio.server()
        self.engine: AsyncEngine | None = None
        self._heartbeat_task: asyncio.Task | None = None
        self._beat_now = asyncio.Event()
        self._shutdown_lock = asyncio.Lock()
        self._stopped = False

    @property
    def address(self) -> str:
        return f"{self.advertise_host}:{self.port}"

    async def start(self) -> None:
        """Listen (health NOT_SERVING), load the model, then serve and register."""
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{self.host}:{self.port}")
        self.worker_id = self.worker_id or f"{socket.gethostname()}-{self.port}"
        await self._set_health(Status.NOT_SERVING)
        await self.server.start()
        try:
            llm_engine = await asyncio.to_thread(self._engine_factory)
        except BaseException:
            await self.server.stop(grace=None)
            raise
        self.engine = AsyncEngine(llm_engine)
        self.engine.start(self._engine_runner)
        self.servicer.engine = self.engine
        self.servicer.on_adapters_changed = self._beat_now.set
        await self._set_health(Status.SERVING)
        if self.redis is not None:
            await self._beat()
            self._heartbeat_task = asyncio.create_task(self._heartbeat_loop())
        logger.info("worker %s serving %s on %s", self.worker_id, self.model_name, self.address)

    def info(self) -> registry.WorkerInfo:
        """What the registry says about this worker now."""
        assert self.engine is not None and self.worker_id is not None
        stats = self.engine.stats
        return registry.WorkerInfo(
            worker_id=self.worker_id,
            address=self.address,
            model=self.model_name,
            adapters=list(stats.adapter_ids),
            running=stats.running,
            waiting=stats.waiting,
            free_kv_blocks=stats.free_kv_blocks,
            total_kv_blocks=stats.total_kv_blocks,
            heartbeat_at=time.time(),
        )

    async def shutdown(self, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        """Drain, then stop: see the module docstring. Later calls wait for the first."""
        self.servicer.draining = True
        async with self._shutdown_lock:
            if not self._stopped:
                await self._drain_and_stop(drain_timeout)
                self._stopped = True

    async def _drain_and_stop(self, drain_timeout: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self._leave_registry()
        try:
            await asyncio.wait_for(self.servicer.wait_idle(), drain_timeout)
        except TimeoutError:
            logger.warning("drain deadline (%.0f s) passed: aborting what is left", drain_timeout)
            if self.engine is not None:
                self.engine.abort_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.servicer.wait_idle(), 5.0)
        await self.server.stop(grace=1.0)
        if self.engine is not None:
            await self.engine.stop()

    async def _set_health(self, status: Status) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def _beat(self) -> None:
        assert self.redis is not None
        try:
            await registry.heartbeat(self.redis, self.redis_prefix, self.info(), self.ttl)
        except (RedisError, OSError) as exc:
            logger.warning("registry heartbeat failed (will retry): %s", exc)

    async def _heartbeat_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), self.heartbeat_interval)
            self._beat_now.clear()
            await self._beat()

    async def _leave_registry(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
            self._heartbeat_task = None
        if self.redis is not None and self.worker_id is not None:
            try:
                await registry.deregister(self.redis, self.redis_prefix, self.worker_id)
            except (RedisError, OSError) as exc:
                logger.warning("could not leave the registry (the TTL will): %s", exc)


def _reachable_host(host: str) -> str:
    """The host to advertise: a wildcard bind address is not one others can dial."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        return socket.gethostname()
    return host


async def serve(
    *,
    model: str | None,
    host: str = "127.0.0.1",
    port: int = 50051,
    dtype: str = "bfloat16",
    redis_url: str | None = None,
    redis_prefix: str = registry.DEFAULT_PREFIX,
    worker_id: str | None = None,
    advertise_host: str | None = None,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
    engine_kwargs: dict | None = None,
    adapter_store: Path | None = None,
    metrics_port: int | None = None,
    engine_loop: MainThreadEngineLoop | None = None,
) -> None:
    """Run a worker until SIGTERM or SIGINT, then drain and stop (``switchboard worker``).

    With ``engine_loop`` this runs off the main thread: the engine's step loop and the
    signal handlers live on the main thread (``worker.main_thread``)."""
    from switchboard.home import DEFAULT_MODEL_NAME
    from worker.default_model import DEFAULT_MODEL_ALIASES, resolve_model_path

    model_name = DEFAULT_MODEL_NAME if model in (None, *DEFAULT_MODEL_ALIASES) else str(model)

    def build_engine() -> LLMEngine:
        path: Path = resolve_model_path(model)
        return LLMEngine(path, dtype=dtype, **(engine_kwargs or {}))

    redis = Redis.from_url(redis_url) if redis_url else None
    server = WorkerServer(
        build_engine,
        model_name=model_name,
        host=host,
        port=port,
        worker_id=worker_id,
        advertise_host=advertise_host,
        redis=redis,
        redis_prefix=redis_prefix,
        adapter_store=adapter_store,
        engine_runner=engine_loop.runner if engine_loop is not None else None,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if engine_loop is not None:
        engine_loop.on_signal(lambda: loop.call_soon_threadsafe(stop.set))
    else:
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        print(f"worker {server.worker_id} listening on {server.address}", flush=True)
        if metrics_port is not None:
            bound = server.metrics.serve(metrics_port, host=host)
            logger.info("metrics on http://%s:%d/metrics", host, bound)
        await stop.wait()
        logger.info("shutting down: draining for up to %.0f s", drain_timeout)
        await server.shutdown(drain_timeout)
    finally:
        if engine_loop is None:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
        if redis is not None:
            await redis.aclose()
