"""The gateway's Prometheus metrics, all named `switchboard_…`, in their own registry.

Served on `SWITCHBOARD_METRICS_PORT` (a listener of its own, for Prometheus) and at /metrics
on the HTTP port behind the admin token: their labels name tenants and adapters. The
registry is not prometheus_client's default one, whose process, platform and gc collectors
export `process_…`/`python_…` names; RSS and CPU come from a ProcessCollector in our
namespace instead (`switchboard_gateway_process_…`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
    start_http_server,
)

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()
ProcessCollector(namespace="switchboard_gateway", registry=REGISTRY)

QUOTA_REJECTIONS = Counter(
    "switchboard_quota_rejections_total",
    "Requests refused by a quota (429), by tenant and the limit that refused them.",
    ["tenant", "reason"],
    registry=REGISTRY,
)
QUOTA_REDIS_ERRORS = Counter(
    "switchboard_quota_redis_errors_total",
    "Quota operations that failed on Redis, by what happened to the request.",
    ["outcome"],
    registry=REGISTRY,
)
REQUESTS = Counter(
    "switchboard_requests_total",
    "Completion and chat requests by tenant, model (base or adapter name), endpoint and final "
    "status (499: the client left; a stream that failed mid-way counts its error's status).",
    ["tenant", "model", "endpoint", "status"],
    registry=REGISTRY,
)
REQUESTS_IN_FLIGHT = Gauge(
    "switchboard_requests_in_flight",
    "Completion and chat requests being served now.",
    registry=REGISTRY,
)
REQUEST_DURATION = Histogram(
    "switchboard_request_duration_seconds",
    "End-to-end time of a completion or chat request, from routing to its last byte.",
    ["endpoint"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320),
    registry=REGISTRY,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "switchboard_time_to_first_token_seconds",
    "From the request's arrival at the gateway to the worker's first token.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40),
    registry=REGISTRY,
)
INTER_TOKEN_LATENCY = Histogram(
    "switchboard_inter_token_latency_seconds",
    "Gap between consecutive streamed deltas of one request.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
    registry=REGISTRY,
)
GATEWAY_ADDED = Histogram(
    "switchboard_gateway_added_seconds",
    "The gateway's own time on a request, by phase: admission, from its arrival (the ASGI "
    "call) to the Generate call going to a worker (auth, quota, tokenizing, routing); relay, "
    "from a worker message to its SSE bytes handed to the HTTP server; request, all of a "
    "request's time up to its response (a stream's: its first chunk) but the wait for the "
    "worker that answered (the x-switchboard-overhead-ms header).",
    ["phase"],
    buckets=(0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25),
    registry=REGISTRY,
)
ADMISSION_TIME = GATEWAY_ADDED.labels("admission")  # bound once: labels() costs a lookup
RELAY_TIME = GATEWAY_ADDED.labels("relay")
REQUEST_OVERHEAD = GATEWAY_ADDED.labels("request")
ABORT_REPORTS = Counter(
    "switchboard_abort_reports_total",
    "Requests whose client left before their end, by what their worker's Abort answered: "
    "found (charged what it generated), not_found, failed (charged what the gateway saw).",
    ["outcome"],
    registry=REGISTRY,
)
GRAMMAR_CHECKS = Counter(
    "switchboard_grammar_checks_total",
    "Grammars (JSON schemas, regexes, tool-call grammars) checked before a worker saw them, "
    "by outcome: cached, valid, invalid, too_large, timeout, crashed (the checker died on it).",
    ["outcome"],
    registry=REGISTRY,
)
REDIS_ERRORS = Counter(
    "switchboard_redis_errors_total",
    "Requests that failed because Redis did not answer (503 state_unavailable).",
    registry=REGISTRY,
)

SCHEDULING_LOOKUP_ERRORS = Counter(
    "switchboard_scheduling_lookup_errors_total",
    "Reads of a tenant's scheduling weight that failed on Redis (the last known weight, or "
    "the default tier's, served instead).",
    registry=REGISTRY,
)
QUEUED_REQUESTS = Gauge(
    "switchboard_queued_requests",
    "Requests waiting in this gateway's fair queue (every worker saturated), by tenant.",
    ["tenant"],
    registry=REGISTRY,
)
QUEUE_WAIT = Histogram(
    "switchboard_queue_wait_seconds",
    "Time a request waited in the fair queue, by tenant, observed as it left (sent to a "
    "worker, timed out or its client gone); requests that did not wait are not observed.",
    ["tenant"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY,
)
QUEUE_REJECTIONS = Counter(
    "switchboard_queue_rejections_total",
    "Requests the fair queue refused, by tenant and reason: full (429, the tenant's queue "
    "held tenant_queue_limit) or timeout (503, waited queue_timeout_s).",
    ["tenant", "reason"],
    registry=REGISTRY,
)

# Label values come only from names the server made or checked, never from what a client
# typed: the model label is a name `resolve_model` found (the base model, or one of the
# tenant's own adapters), anything else `unknown`; tenants are authenticated names; the
# other labels are fixed words and status codes. So a client cannot grow the series.
UNKNOWN = "unknown"
MAX_KNOWN_MODELS = 10_000  # (tenant, model) pairs; past it new names count as unknown
_known_models: set[tuple[str, str]] = set()


def known_model(tenant: str, model: str) -> None:
    """`model` resolved for `tenant`: from now on it may be a label value."""
    if len(_known_models) < MAX_KNOWN_MODELS:
        _known_models.add((tenant, model))


def model_label(tenant: str, model: str) -> str:
    return model if (tenant, model) in _known_models else UNKNOWN


@dataclass(slots=True)
class RequestObservation:
    """One completion or chat request, from arrival to `finish` (called once, any path)."""

    tenant: str
    model: str
    endpoint: str
    started: float = field(default_factory=time.monotonic)
    done: bool = False

    def __post_init__(self) -> None:
        REQUESTS_IN_FLIGHT.inc()

    def finish(self, status: int) -> None:
        if self.done:
            return
        self.done = True
        REQUESTS_IN_FLIGHT.dec()
        elapsed = time.monotonic() - self.started
        model = model_label(self.tenant, self.model)
        REQUESTS.labels(self.tenant, model, self.endpoint, str(status)).inc()
        REQUEST_DURATION.labels(self.endpoint).observe(elapsed)
        log.info("%s %s for %s: %d in %.3f s", self.endpoint, model, self.tenant, status, elapsed)


def exposition() -> bytes:
    """Every gateway metric in Prometheus' text format (what /metrics answers)."""
    return generate_latest(REGISTRY)


@dataclass(slots=True)
class MetricsListener:
    """The separate /metrics listener, a daemon thread; `close` frees its port, so a process
    that starts and stops several apps (tests) keeps none of theirs."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.server.server_port

    def close(self) -> None:
        self.server.shutdown()  # blocks until serve_forever's next poll (at most 0.5 s)
        self.server.server_close()
        self.thread.join()


def start_listener(port: int, *, host: str) -> MetricsListener:
    """Serve the registry on `host:port` (0: any free port) without authentication: only
    Prometheus may reach that port (k8s/base/network-policy.yaml)."""
    server, thread = start_http_server(port, addr=host, registry=REGISTRY)
    return MetricsListener(server, thread)
