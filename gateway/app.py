"""The gateway's FastAPI app, built by `create_app(settings)`.

The lifespan opens what requests share — the Redis pool, the tokenizer, the gRPC channels —
and, with `metrics_port` set, Prometheus' own listener, with `admin_port` set, the admin
app's listener; it closes them on shutdown. Every app sizes and paces request bodies first
(`gateway.limits`). Routes are thin; the logic lives in `gateway.pipeline` (completions and
chat), `gateway.tenancy.tenants` and `gateway.uploads.registration`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis
from fastapi import Depends, FastAPI, Response
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from adapters.stores import open_store
from gateway import account_routes, adapter_routes, admin_routes, metrics, openai_routes, pipeline
from gateway.batch import routes as batch_routes
from gateway.batch import storage as batch_storage
from gateway.batch.batches import BatchService
from gateway.batch.files import FileLimits, FileService
from gateway.batch.runner import BatchRunner, RunnerConfig
from gateway.console import pages as console
from gateway.console.bridge import ConsoleBridge
from gateway.console.session import ADMIN, TENANT
from gateway.deps import State, require_admin
from gateway.error_handlers import install_error_handlers
from gateway.fair_queue import FairQueue
from gateway.fleet.bases import BaseCatalog
from gateway.http_server import start_side_listener
from gateway.job import Job
from gateway.limits import BodyLimits, RequestBodyGuard
from gateway.parsing import OpenAIRequest
from gateway.routing import WorkerDirectory
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from gateway.structured.grammar_checker import GrammarChecker, GrammarLimits
from gateway.tally import Tally
from gateway.tenancy.quotas import QuotaService
from gateway.tenancy.tenants import Caller, TenantStore
from gateway.tenancy.weights import TenantWeights
from gateway.uploads.catalog import AdapterCatalog
from gateway.worker_client import WorkerChannels, WorkerCredentials

log = logging.getLogger(__name__)


async def open_state(settings: GatewaySettings) -> GatewayState:
    """Everything the requests share; the caller closes it (`GatewayState.close`)."""
    bases = await BaseCatalog.open(
        settings.model,
        name=settings.served_model_name,
        max_model_len=settings.max_model_len,
        roots=settings.model_roots or [settings.model],
        threads=settings.tokenizer_threads,
    )
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=settings.redis_max_connections,
        timeout=settings.redis_timeout_s,
        socket_timeout=settings.redis_timeout_s,
        socket_connect_timeout=settings.redis_timeout_s,
        decode_responses=True,
    )
    # Two quick retries ride out a Redis restart or failover blip; past them the request
    # gets its 503 in well under a second instead of redis-py's default multi-second backoff.
    client = aioredis.Redis(
        connection_pool=pool, retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=2)
    )
    model_names = frozenset({settings.served_model_name, str(settings.model), settings.model.name})
    tenants = TenantStore(client, prefix=settings.key_prefix, key_cache_s=settings.api_key_cache_s)
    # The one place the store's backend is chosen: the filesystem, or object storage.
    store = await asyncio.to_thread(
        open_store,
        settings.adapter_store_url,
        local=settings.adapter_store,
        endpoint_url=settings.adapter_store_endpoint or None,
    )
    files = FileService(
        client,
        prefix=settings.key_prefix,
        # Batch files follow the adapter store: its volume, or its bucket (every replica's).
        blobs=await asyncio.to_thread(
            batch_storage.open_file_blobs,
            store_url=settings.adapter_store_url,
            local=settings.adapter_store / batch_storage.FOLDER,
            override=settings.batch_file_store,
            endpoint_url=settings.adapter_store_endpoint or None,
        ),
        limits=FileLimits(
            quota_bytes=settings.batch_storage_bytes_per_tenant,
            retention_s=settings.batch_file_retention_s,
        ),
    )
    return GatewayState(
        settings=settings,
        redis=client,
        tenants=tenants,
        bases=bases,
        adapter_store=store,
        catalog=AdapterCatalog.from_settings(
            settings, redis=client, tenants=tenants, store=store, config=bases.default.config
        ),
        quotas=QuotaService(
            client,
            prefix=settings.key_prefix,
            lease_s=settings.quota_lease_s,
            fail_open=settings.quota_fail_mode == "open",
        ),
        workers=WorkerDirectory(
            redis=client,
            prefix=settings.key_prefix,
            model_names=model_names,
            default_base=settings.served_model_name,
            heartbeat_ttl_s=settings.worker_heartbeat_ttl_s,
            cache_s=settings.worker_cache_s,
            load_factor=settings.route_load_factor,
            load_slack=settings.route_load_slack,
        ),
        channels=WorkerChannels(WorkerCredentials.from_settings(settings)),
        weights=TenantWeights(
            client,
            prefix=settings.key_prefix,
            tiers=settings.scheduling_tiers,
            default_tier=settings.default_scheduling_tier,
            cache_s=settings.scheduling_cache_s,
        ),
        fair_queue=FairQueue(
            max_in_flight=settings.worker_max_in_flight,
            tenant_queue_limit=settings.tenant_queue_limit,
            timeout_s=settings.queue_timeout_s,
        ),
        grammars=GrammarChecker(
            GrammarLimits(
                max_bytes=settings.max_grammar_bytes,
                cache_entries=settings.grammar_cache_entries,
                children=settings.grammar_checkers,
                timeout_s=settings.grammar_check_timeout_s,
                per_tenant=settings.grammar_checks_per_tenant,
                queue_limit=settings.grammar_check_queue_per_tenant,
            )
        ),
        batch_files=files,
        batches=BatchService(
            client,
            prefix=settings.key_prefix,
            files=files,
            windows=settings.batch_completion_windows,
        ),
    )


def batch_runner(state: GatewayState) -> BatchRunner:
    """This replica's runner of batch lines, through the request pipeline."""
    settings = state.settings

    async def resolve(tenant: str, body: OpenAIRequest) -> Job:
        return await pipeline.resolve_line(body, state=state, caller=Caller(tenant, "batch"))

    async def answer(body: OpenAIRequest, job: Job, tally: Tally) -> dict:
        return await pipeline.answer_line(body, job, state=state, tally=tally)

    return BatchRunner(
        state.redis,
        batches=state.batches,
        files=state.batch_files,
        resolve=resolve,
        answer=answer,
        config=RunnerConfig(
            max_batches=settings.batch_runner_batches,
            lines_in_flight=settings.batch_lines_in_flight,
            lease_s=settings.batch_lease_s,
            poll_s=settings.batch_poll_s,
            max_lines=settings.max_batch_lines,
        ),
    )


class StampArrival:
    """Puts the monotonic time a request reached the app in ``request.state.arrived``, so
    the gateway's own share of a request's latency includes parsing and validation."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrived"] = time.monotonic()
        await self.app(scope, receive, send)


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    """The app; `settings` default to the `SWITCHBOARD_*` environment.

    With `admin_port` set, /admin, /metrics and the docs are served only by a second app
    on that port (`app.state.admin_port`), started and stopped by this one's lifespan."""
    settings = settings or GatewaySettings()
    separate = settings.admin_port is not None
    admin_app = _admin_app(settings) if separate and (settings.admin_api or settings.docs) else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = await open_state(settings)
        app.state.gateway = state
        state.spawn(state.catalog.keep_swept())  # the adapter store's crash leftovers
        if settings.batch_runner_batches:
            state.spawn(batch_runner(state).run_forever())
        listener = admin = None
        try:
            if settings.metrics_port is not None:
                listener = metrics.start_listener(settings.metrics_port, host=settings.host)
                app.state.metrics_port = listener.port
                log.info("metrics on http://%s:%d/metrics", settings.host, listener.port)
            if admin_app is not None:
                admin_app.state.gateway = state
                admin = await start_side_listener(
                    admin_app, settings, host=settings.admin_host, port=settings.admin_port
                )
                app.state.admin_port = admin[0].port
                log.info("admin on http://%s:%d/admin", settings.admin_host, admin[0].port)
            yield
        finally:
            if admin is not None:
                admin[0].should_exit = True
                await admin[1]
            if listener is not None:
                await asyncio.to_thread(listener.close)
            await state.close()

    app = FastAPI(
        title="Switchboard gateway",
        version=VERSION,
        lifespan=lifespan,
        **_docs_urls(settings.docs and not separate),
    )
    _build(app, settings, public=True, admin=settings.admin_api and not separate)
    if admin_app is not None:
        # The admin port's docs describe both ports' routes.
        admin_app.openapi = lambda: _openapi(admin_app, app)  # type: ignore[method-assign]
    return app


VERSION = "0.1.0"


def _docs_urls(enabled: bool) -> dict[str, str | None]:
    if enabled:
        return {}
    return {"docs_url": None, "redoc_url": None, "openapi_url": None}


def _admin_app(settings: GatewaySettings) -> FastAPI:
    app = FastAPI(title="Switchboard gateway (admin)", version=VERSION, **_docs_urls(settings.docs))
    _build(app, settings, public=False, admin=settings.admin_api)
    return app


def _openapi(admin_app: FastAPI, public: FastAPI) -> dict[str, Any]:
    if admin_app.openapi_schema is None:
        admin_app.openapi_schema = get_openapi(
            title=public.title,
            version=VERSION,
            routes=[*public.routes, *(r for r in admin_app.routes if not _also_public(r))],
        )
    return admin_app.openapi_schema


def _also_public(route: Any) -> bool:
    return getattr(route, "path", None) in {"/health", "/ready"}


def _build(app: FastAPI, settings: GatewaySettings, *, public: bool, admin: bool) -> None:
    """Routes and middleware of the public app and/or the admin routes."""
    app.add_middleware(StampArrival)
    install_error_handlers(app)
    if public:
        app.include_router(openai_routes.router)
        app.include_router(adapter_routes.router)
        app.include_router(account_routes.router)
        app.include_router(batch_routes.router)
        app.include_router(console.router(TENANT))
    if admin:
        app.include_router(admin_routes.router)
        app.include_router(console.router(ADMIN))

        @app.get("/metrics", include_in_schema=False, dependencies=[Depends(require_admin)])
        async def metrics_text() -> Response:
            """This process's `switchboard_…` metrics, for the admin only: their labels name
            every tenant and adapter. Prometheus scrapes `metrics_port` instead."""
            return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    if public or admin:
        app.mount(console.STATIC_PATH, console.static_files(), name="console-static")

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: the process serves HTTP."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(state: State) -> dict[str, str]:
        """Readiness: Redis answers (a Redis error becomes a 503 in OpenAI's format)."""
        await state.redis.ping()
        return {"status": "ready"}

    # Outermost of ours: sizes and paces bodies before any route, parser or dependency.
    limits = BodyLimits(
        generation=settings.max_request_body_bytes,
        upload=settings.max_upload_bytes,
        other=settings.max_small_body_bytes,
        files=settings.max_batch_file_bytes + (64 << 10),
    )
    app.add_middleware(RequestBodyGuard, limits=limits, read_timeout_s=settings.http_body_timeout_s)
    # Outside the guard: the console's API calls reach it (and the routes) as the API's paths.
    sides = (TENANT,) * public + (ADMIN,) * admin
    app.add_middleware(ConsoleBridge, sides=sides)
