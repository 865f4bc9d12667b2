"""The worker's gRPC server: ``Worker`` (proto/rpc/worker.proto) and ``grpc.health.v1``.

One process serves one engine. The engine steps on the process's main thread
(``MainThreadEngineLoop``), gRPC's asyncio loop beside it; the handlers
(``worker.serving.servicer``) only translate messages, enqueue, stream and abort. The worker
publishes itself to the Redis registry every heartbeat, and on SIGTERM/SIGINT it drains: health goes
NOT_SERVING, it leaves the registry, new Generate calls get UNAVAILABLE, running ones finish
(up to a deadline, after which they are aborted), then it stops. A tensor-parallel worker
whose group loses a rank stops the same way at once, without the drain (its engine can
run no more steps), and ``serve`` raises the group's error: the process exits non-zero.

Callers authenticate (``worker.serving.auth``): mutual TLS and/or a shared token over TLS; without
either the worker refuses to listen anywhere but loopback. ``health_port`` serves
``grpc.health.v1`` alone in plaintext, for probes that can present no certificate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, RedisError

from adapters.stores import AdapterStore, open_store
from rpc import worker_pb2, worker_pb2_grpc
from runtime import registry
from runtime.bases import base_content_id, base_name_for
from switchboard_kernels.openmp import serial_openmp_here
from worker.engine.llm_engine import LLMEngine
from worker.errors import TensorParallelError, WorkerStartupError
from worker.serving.async_engine import AsyncEngine
from worker.serving.auth import WorkerAuth, WorkerAuthError
from worker.serving.engine_loop import settle_future
from worker.serving.main_thread import STOP_SIGNALS, MainThreadEngineLoop
from worker.serving.metrics import WorkerMetrics
from worker.serving.servicer import WorkerServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
DEFAULT_DRAIN_TIMEOUT_S = 30.0
# A failed tensor-parallel group's worker stops within this, or exits regardless.
FAILED_GROUP_STOP_S = 15.0
Status = health_pb2.HealthCheckResponse.ServingStatus


class WorkerServer:
    """The gRPC server, health service, engine loop and registry heartbeat of one worker."""

    def __init__(
        self,
        engine_factory: Callable[[], LLMEngine],
        *,
        model_name: str,
        base_id: str = "",
        model_path: str = "",
        host: str = "127.0.0.1",
        port: int = 0,
        worker_id: str | None = None,
        advertise_host: str | None = None,
        redis: Redis | None = None,
        redis_prefix: str = registry.DEFAULT_PREFIX,
        ttl: float = registry.DEFAULT_TTL_S,
        heartbeat_interval: float = registry.HEARTBEAT_INTERVAL_S,
        adapter_store: AdapterStore | Path | None = None,
        engine_runner: Callable[[Callable[[], None]], None] | None = None,
        auth: WorkerAuth | None = None,
        health_port: int | None = None,
        on_failure: Callable[[], None] | None = None,
        warmup: bool = False,
    ) -> None:
        """``on_failure``: called on the event loop when the engine's tensor-parallel group
        fails (``failure`` then says why); the caller should stop the server. ``warmup``:
        run the engine's warm-up (`LLMEngine.warm_up`) before reporting SERVING."""
        self.auth = auth or WorkerAuth()
        self.auth.check(host)  # before anything slow: a misconfigured worker fails at once
        self.health_port = health_port
        self._engine_factory = engine_factory
        self._engine_runner = engine_runner  # see AsyncEngine.start
        self.model_name = model_name
        self.base_id = base_id  # runtime.bases.base_content_id of the checkpoint
        self.model_path = model_path
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
            model_name=model_name,
            base_id=base_id,
            metrics=self.metrics,
            adapter_store=adapter_store,
        )
        self.health = health_aio.HealthServicer()
        self.server = grpc.aio.server(interceptors=self.auth.interceptors())
        self._health_server = grpc.aio.server() if health_port is not None else None
        self.engine: AsyncEngine | None = None
        self._heartbeat_task: asyncio.Task | None = None
        self._beat_now = asyncio.Event()
        self._shutdown_lock = asyncio.Lock()
        self._stopped = False
        self._on_failure = on_failure or (lambda: None)
        self.warmup = warmup
        self.failure: TensorParallelError | None = None

    async def _build_engine(self) -> LLMEngine:
        """The engine, built on the thread that will run its steps when a runner hands them
        one (the main thread): torch's ops while loading and the kernels' measurement there
        start no OpenMP team on a pool thread, which would slow every step after
        (``switchboard_kernels.openmp``). Without a runner, on a pool thread."""
        if self._engine_runner is None:
            return await asyncio.to_thread(self._engine_factory)
        loop = asyncio.get_running_loop()
        built: asyncio.Future[LLMEngine] = loop.create_future()

        def build() -> None:
            try:
                engine = self._engine_factory()
            except BaseException as exc:  # raised on the event loop, not on the main thread
                loop.call_soon_threadsafe(settle_future, built, None, exc)
            else:
                loop.call_soon_threadsafe(settle_future, built, engine, None)

        self._engine_runner(build)
        return await built

    @property
    def address(self) -> str:
        return f"{self.advertise_host}:{self.port}"

    async def start(self) -> None:
        """Listen (health NOT_SERVING), load the model, then serve and register."""
        await self._check_redis_credentials()
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        credentials = self.auth.server_credentials()
        address = f"{self.host}:{self.port}"
        self.port = _bind(self.server, address, credentials, flag="--port")
        self.worker_id = self.worker_id or f"{socket.gethostname()}-{self.port}"
        await self._set_health(Status.NOT_SERVING)
        await self.server.start()
        if self._health_server is not None:
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
            self.health_port = _bind(
                self._health_server, f"{self.host}:{self.health_port}", None, flag="--health-port"
            )
            await self._health_server.start()
        try:
            llm_engine = await self._build_engine()
        except BaseException:
            await self._stop_servers(grace=None)
            raise
        if llm_engine.tensor_parallel is not None:
            loop = asyncio.get_running_loop()
            llm_engine.tensor_parallel.on_failure(
                lambda exc: loop.call_soon_threadsafe(self._group_failed, exc)
            )
        self.engine = AsyncEngine(llm_engine)
        self.engine.start(self._engine_runner)
        if self.warmup:
            try:
                await self.engine.warm_up()
            except Exception:  # only speed is lost: serve cold rather than not at all
                logger.exception("the engine's warm-up failed; serving without it")
        self.servicer.engine = self.engine
        self.servicer.on_adapters_changed = self._beat_now.set
        await self._set_health(Status.SERVING)
        if self.redis is not None:
            await self._beat()
            self._heartbeat_task = asyncio.create_task(self._heartbeat_loop())
        logger.info("worker %s serving %s on %s", self.worker_id, self.model_name, self.address)

    def declare_base(self, *, base_id: str, model_path: str) -> None:
        """The base's content id and checkpoint, once the engine factory has found them."""
        self.base_id = self.servicer.base_id = base_id
        self.model_path = model_path

    def _group_failed(self, exc: TensorParallelError) -> None:
        self.failure = exc
        logger.error("the tensor-parallel group failed (%s): this worker stops", exc)
        self._on_failure()

    def info(self) -> registry.WorkerInfo:
        """What the registry says about this worker now."""
        assert self.engine is not None and self.worker_id is not None
        stats = self.engine.stats
        return registry.WorkerInfo(
            worker_id=self.worker_id,
            address=self.address,
            model=self.model_name,
            base_id=self.base_id,
            model_path=self.model_path,
            adapters=list(stats.adapter_ids),
            slot_adapters=list(stats.residency.slots),
            loading_adapters=list(stats.waiting_adapters),
            host_adapters=list(stats.residency.host),
            host_cache_bytes=stats.residency.host_bytes,
            host_cache_limit=stats.residency.host_limit,
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
            # asyncio.timeout, not wait_for: an idle worker passes even a deadline of 0 s
            # (wait_for(..., 0) times out before the wait has run at all).
            async with asyncio.timeout(drain_timeout):
                await self.servicer.wait_idle()
        except TimeoutError:
            logger.warning("drain deadline (%.0f s) passed: aborting what is left", drain_timeout)
            if self.engine is not None:
                self.engine.abort_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.servicer.wait_idle(), 5.0)
        await self._stop_servers(grace=1.0)
        if self.engine is not None:
            await self.engine.stop()
            await asyncio.to_thread(self.engine.engine.shutdown)  # a group's other ranks

    async def _stop_servers(self, *, grace: float | None) -> None:
        await self.server.stop(grace=grace)
        if self._health_server is not None:
            await self._health_server.stop(grace=None)

    async def _set_health(self, status: Status) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def _check_redis_credentials(self) -> None:
        """A wrong or missing Redis password never heals: say so now, not every heartbeat.
        Redis being down is different: the worker serves and its heartbeats retry."""
        if self.redis is None:
            return
        try:
            await asyncio.wait_for(self.redis.ping(), 5.0)
        except AuthenticationError as exc:
            raise WorkerAuthError(
                f"Redis refused the worker's credentials ({exc}): give the password in "
                "--redis-url (redis://:PASSWORD@host:port/0, or user:PASSWORD@)"
            ) from exc
        except (RedisError, OSError, TimeoutError):
            pass

    async def _beat(self) -> None:
        assert self.redis is not None
        try:
            await registry.heartbeat(self.redis, self.redis_prefix, self.info(), self.ttl)
        except (RedisError, OSError) as exc:
            self.metrics.registry_errors.inc()
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
                self.metrics.registry_errors.inc()
                logger.warning("could not leave the registry (the TTL will): %s", exc)


async def _stop_failed(server: WorkerServer) -> None:
    """Leave the registry and stop without a drain; a step loop stuck in a collective (a
    GPU group's dead peer) must not keep the process alive: exit regardless after a while."""
    try:
        await asyncio.wait_for(server.shutdown(drain_timeout=0.0), FAILED_GROUP_STOP_S)
    except TimeoutError:
        logger.error("the failed worker did not stop in %.0f s: exiting", FAILED_GROUP_STOP_S)
        os._exit(1)


def _bind(
    server: grpc.aio.Server,
    address: str,
    credentials: grpc.ServerCredentials | None,
    *,
    flag: str,
) -> int:
    """Bind ``address``; the port. A taken port is the operator's to fix: say which flag."""
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # grpc's way of saying the bind failed
        raise WorkerStartupError(
            f"cannot listen on {address} (taken, or not an address of this host): "
            f"choose another {flag} (0: any free port)"
        ) from exc


def _reachable_host(host: str) -> str:
    """The host to advertise: a wildcard bind address is not one others can dial."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        return socket.gethostname()
    return host


async def run_worker(
    *,
    model: str | None,
    served_model_name: str | None = None,
    host: str = "127.0.0.1",
    port: int = 50051,
    dtype: str = "auto",
    redis_url: str | None = None,
    redis_prefix: str = registry.DEFAULT_PREFIX,
    worker_id: str | None = None,
    advertise_host: str | None = None,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
    engine_kwargs: dict | None = None,
    adapter_store: Path | None = None,
    adapter_store_url: str | None = None,
    adapter_store_endpoint: str | None = None,
    adapter_cache_bytes: int = 4 << 30,
    metrics_port: int | None = None,
    engine_loop: MainThreadEngineLoop | None = None,
    auth: WorkerAuth | None = None,
    health_port: int | None = None,
    warmup: bool = True,
) -> None:
    """Run a worker until SIGTERM or SIGINT, then drain and stop (``switchboard worker``).

    With ``engine_loop`` this runs off the main thread: the engine's step loop and the
    signal handlers live on the main thread (``worker.serving.main_thread``)."""
    from runtime.home import DEFAULT_MODEL_NAME
    from worker.core.config import engine_config
    from worker.model.default_model import DEFAULT_MODEL_ALIASES, resolve_model_path

    is_default = model in (None, *DEFAULT_MODEL_ALIASES)
    model_name = served_model_name or (
        DEFAULT_MODEL_NAME if is_default else base_name_for(str(model))
    )

    def build_engine() -> LLMEngine:
        path: Path = resolve_model_path(model)
        # Published before the first heartbeat: the gateway pools workers by base and reads
        # the base's tokenizer from this checkpoint.
        server.declare_base(base_id=base_content_id(path), model_path=str(path))
        return LLMEngine(path, engine_config(dtype=dtype, **(engine_kwargs or {})))

    (auth or WorkerAuth()).check(host)  # before connecting to anything
    # The one place the worker's store backend is chosen: the filesystem at `adapter_store`,
    # or object storage with `adapter_store` as its cache; loaded adapters stay cached.
    store = (
        None
        if adapter_store is None
        else await asyncio.to_thread(
            open_store,
            adapter_store_url,
            local=adapter_store,
            endpoint_url=adapter_store_endpoint,
            cache_bytes=adapter_cache_bytes,
            pinned=lambda: server.engine.stats.adapter_ids if server.engine else (),
        )
    )
    # Password and TLS come with the URL (redis://user:pass@..., rediss://...?ssl_ca_certs=...).
    redis = Redis.from_url(redis_url) if redis_url else None
    stop = asyncio.Event()
    server = WorkerServer(
        build_engine,
        model_name=model_name,
        host=host,
        port=port,
        worker_id=worker_id,
        advertise_host=advertise_host,
        redis=redis,
        redis_prefix=redis_prefix,
        adapter_store=store,
        engine_runner=engine_loop.runner if engine_loop is not None else None,
        auth=auth,
        health_port=health_port,
        on_failure=stop.set,
        warmup=warmup,
    )
    loop = asyncio.get_running_loop()
    if engine_loop is not None:
        engine_loop.on_signal(lambda: loop.call_soon_threadsafe(stop.set))
        # The steps own OpenMP: this thread's and the pool threads' torch work (an adapter
        # read, a grammar prepared) runs serially (switchboard_kernels.openmp).
        serial_openmp_here()
        loop.set_default_executor(
            ThreadPoolExecutor(thread_name_prefix="worker-pool", initializer=serial_openmp_here)
        )
    else:
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)
    try:
        if metrics_port is not None:  # first: a taken port stops us before the model loads
            bound = server.metrics.start_listener(metrics_port, host=host)
            logger.info("metrics on http://%s:%d/metrics", host, bound)
        try:
            await server.start()
            print(f"worker {server.worker_id} listening on {server.address}", flush=True)
            await stop.wait()
            if server.failure is not None:
                await _stop_failed(server)
                raise server.failure
            logger.info("shutting down: draining for up to %.0f s", drain_timeout)
            await server.shutdown(drain_timeout)
        finally:
            # Whatever ends this loop (a failed start included) ends the engine's step loop
            # too; a no-op after a drain. Left running on the main thread, it would keep a
            # process that no longer serves alive, and registered, until it is killed.
            await server.shutdown(drain_timeout=0.0)
    finally:
        if engine_loop is None:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
        if redis is not None:
            await redis.aclose()
