"""The worker's Prometheus metrics (`switchboard_worker_…`), served on `--metrics-port`.

Engine state (queue, running sequences, KV blocks, prefix cache, adapters) is read from the
engine's published stats snapshot when Prometheus scrapes, so the step loop pays nothing for
it. Events the gRPC side sees (requests, tokens, adapter loads) are counted as they happen.
Each `WorkerMetrics` has its own registry: several workers in one process (tests) never
collide.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from worker.core.fairness import QUEUE_TIME_BUCKETS, TenantService
from worker.engine.engine_stats import EngineStats
from worker.errors import WorkerStartupError
from worker.spec_decode.stats import SpecDecodeStats


class EngineStatsCollector(Collector):
    """Gauges and counters from `EngineStats`, read at scrape time (None: still loading)."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        if stats is None:
            return
        yield _gauge("running_sequences", "Sequences in the running batch.", stats.running)
        yield _gauge(
            "waiting_sequences", "Sequences queued for admission (queue length).", stats.waiting
        )
        yield _gauge("kv_blocks_total", "KV cache blocks in the pool.", stats.total_kv_blocks)
        yield _gauge("kv_blocks_free", "KV cache blocks free now.", stats.free_kv_blocks)
        used = 1.0 - stats.free_kv_blocks / stats.total_kv_blocks if stats.total_kv_blocks else 0
        yield _gauge("kv_usage_ratio", "Fraction of KV cache blocks in use.", used)
        cache = stats.prefix_cache
        yield _counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", cache.queries
        )
        yield _counter("prefix_cache_hits", "Prompt tokens served from the cache.", cache.hits)
        yield _counter(
            "prefix_cache_evictions", "Cached blocks reclaimed for new content.", cache.evictions
        )
        yield _gauge(
            "prefix_cache_blocks", "Blocks whose content is reusable now.", cache.cached_blocks
        )
        yield _gauge("adapters_loaded", "LoRA adapters loaded (named).", len(stats.adapter_ids))
        where = stats.residency
        yield _gauge(
            "adapter_slots_used",
            "Device adapter slots holding an adapter.",
            sum(s is not None for s in where.slots),
        )
        yield _gauge("adapter_slots_total", "Device adapter slots (max_loras).", len(where.slots))
        yield _gauge("adapters_in_host_cache", "Adapters in the host cache.", len(where.host))
        yield _gauge(
            "adapter_host_cache_bytes",
            "Bytes of adapter weights in the host cache.",
            where.host_bytes,
        )
        yield _counter(
            "batch_steps_stopped",
            "Steps of batch work alone stopped midway for interactive arrivals, then run again.",
            stats.batch_steps_stopped,
        )
        yield lora_requests_info(stats, now=time.time())
        evictions = CounterMetricFamily(
            "switchboard_worker_adapter_evictions",
            "Adapters evicted: from a device slot (refilled for another adapter) or from the "
            "host cache (read from the store again when next needed).",
            labels=["tier"],
        )
        for tier, count in zip(("slot", "host"), stats.adapter_evictions, strict=True):
            evictions.add_metric([tier], count)
        yield evictions
        if stats.spec_decode is not None:
            yield from _speculation(stats.spec_decode)
        yield from _tenants(stats.tenants)


def lora_requests_info(stats: EngineStats, *, now: float) -> Metric:
    """Slot state in the shape the Gateway API Inference Extension's LoRA-affinity scorer
    reads from vLLM (`vllm:lora_requests_info`): one series whose labels list the adapters
    in device slots and those waiting for one (content ids, comma-separated) and the slot
    count; its value is the scrape time, as vLLM's is (the scorer keeps the newest series)."""
    slots = stats.residency.slots
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running and waiting LoRA adapters (content ids) and the adapter slots.",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    running = ",".join(a for a in slots if a is not None)
    info.add_metric([running, ",".join(stats.waiting_adapters), str(len(slots))], now)
    return info


def _tenants(tenants: tuple[TenantService, ...]) -> Iterator[Metric]:
    """Fair scheduling per tenant. Tenant names come from the gateway, which sends only
    tenants it has authenticated, so the label's values are bounded by the tenants."""
    service = CounterMetricFamily(
        "switchboard_worker_tenant_service_tokens",
        "Tokens computed for a tenant (prefix-cache hits and recomputes not counted; a prompt "
        "position scored for its logprobs counts as the prompt tokens its scoring costs).",
        labels=["tenant", "kind"],
    )
    counter = GaugeMetricFamily(
        "switchboard_worker_tenant_virtual_counter",
        "A tenant's virtual token counter: weighted tokens served over its weight.",
        labels=["tenant"],
    )
    weight = GaugeMetricFamily(
        "switchboard_worker_tenant_weight", "A tenant's scheduling weight.", labels=["tenant"]
    )
    queue = HistogramMetricFamily(
        "switchboard_worker_tenant_queue_seconds",
        "Time from arrival to first scheduling, per tenant.",
        labels=["tenant"],
    )
    first_token = HistogramMetricFamily(
        "switchboard_worker_tenant_first_token_seconds",
        "Time from arrival at the engine to the first token, per tenant (the engine's own "
        "TTFT; a client's beyond it is the serving path's).",
        labels=["tenant"],
    )
    bounds = ["+Inf" if b == float("inf") else repr(b) for b in QUEUE_TIME_BUCKETS]
    for t in tenants:
        name = t.tenant or "-"
        service.add_metric([name, "prefill"], t.prefill_tokens)
        service.add_metric([name, "decode"], t.decode_tokens)
        counter.add_metric([name], t.counter)
        weight.add_metric([name], t.weight)
        queue.add_metric(
            [name], list(zip(bounds, t.queue_time_buckets, strict=True)), t.queue_time_sum
        )
        first_token.add_metric(
            [name], list(zip(bounds, t.first_token_buckets, strict=True)), t.first_token_sum
        )
    yield from (service, counter, weight, queue, first_token)


def _speculation(spec: SpecDecodeStats) -> Iterator[Metric]:
    yield _counter(
        "spec_proposed_tokens", "Draft tokens verified by the target.", spec.num_proposed
    )
    yield _counter("spec_accepted_tokens", "Draft tokens accepted.", spec.num_accepted)
    yield _counter(
        "spec_emitted_tokens",
        "Tokens produced by verifications (accepted drafts plus one each).",
        spec.num_emitted,
    )
    yield _counter(
        "spec_verifications",
        "Sequences' drafts checked, one per step each.",
        spec.num_verifications,
    )
    yield _counter(
        "spec_backoff_steps", "Steps that did not speculate (large batch).", spec.num_backoff_steps
    )
    by_position = CounterMetricFamily(
        "switchboard_worker_spec_accepted_by_position",
        "Draft tokens accepted, by position in the draft (0 = first).",
        labels=["position"],
    )
    for position, accepted in enumerate(spec.accepted_per_position):
        by_position.add_metric([str(position)], accepted)
    yield by_position


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"switchboard_worker_{name}", text, value=value)


def _counter(name: str, text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"switchboard_worker_{name}", text, value=value)


class WorkerMetrics:
    """Everything one worker exports; `start_listener(port)` starts the /metrics HTTP endpoint."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(stats))
        self.requests = Counter(
            "switchboard_worker_requests",
            "Generate calls by outcome (ok, error code, cancelled).",
            ["outcome"],
            registry=self.registry,
        )
        self.generated_tokens = Counter(
            "switchboard_worker_generated_tokens",
            "Tokens generated, all samples of all requests.",
            registry=self.registry,
        )
        self.adapter_loads = Counter(
            "switchboard_worker_adapter_loads",
            "Adapters read from the store into the host cache, by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        self.adapter_unloads = Counter(
            "switchboard_worker_adapter_unloads",
            "Adapters unloaded on request (deleted by their last owner).",
            registry=self.registry,
        )
        self.registry_errors = Counter(
            "switchboard_worker_registry_errors",
            "Registry heartbeats (or the goodbye) that failed on Redis; the gateway drops a "
            "worker whose record outlives its TTL.",
            registry=self.registry,
        )
        self.adapter_load_seconds = Histogram(
            "switchboard_worker_adapter_load_seconds",
            "Time to read, validate and register an adapter.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=self.registry,
        )

    def start_listener(self, port: int, *, host: str) -> int:
        """Serve /metrics on `host:port` (0: any free port) in a daemon thread; the port."""
        try:
            server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise WorkerStartupError(
                f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}): choose "
                "another --metrics-port (0: any free port, -1: none)"
            ) from exc
        return server.server_port
