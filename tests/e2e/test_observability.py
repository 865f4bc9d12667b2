"""Observability across the gateway → worker hop: the worker's /metrics moves with real
requests and adapter loads, and one request id marks the JSON log lines of both processes'
code paths (here both run in this process: the real gateway app and a real WorkerServer)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from adapters import FilesystemAdapterStore, load_adapter_dir
from adapters.base_model import BaseModelSpec
from factories import add_byte_level_tokenizer, make_checkpoint, make_peft_adapter
from gateway_support import delete_prefix, gateway_settings, running_gateway
from runtime.logs import configure_logging
from worker.core.config import engine_config
from worker.engine.llm_engine import LLMEngine
from worker.serving.server import WorkerServer


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("obs-base"), vocab_size=512, seed=4)
    return add_byte_level_tokenizer(path)


def scrape(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def fleet_holding(admin: httpx.AsyncClient, adapter_id: str) -> list[dict]:
    """/admin/workers once a heartbeat has published `adapter_id` in a device slot (a beat
    comes every 2 s; bounded so a worker that never publishes it fails the test)."""
    for _ in range(200):
        fleet = (await admin.get("/admin/workers")).json()["data"]
        if any(adapter_id in w["slot_adapters"] for w in fleet):
            return fleet
        await asyncio.sleep(0.1)
    raise AssertionError(f"no worker published {adapter_id} in a slot: {fleet}")


@pytest.fixture
def json_logs():
    """A function returning the JSON log lines written so far during the test, parsed."""
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    stream = io.StringIO()
    configure_logging(level="INFO", json_lines=True, stream=stream)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    root.handlers[:] = saved_handlers
    root.setLevel(saved_level)


async def test_worker_metrics_and_request_ids_across_the_hop(
    base, redis_url, redis_prefix, tmp_path, json_logs
):
    store = FilesystemAdapterStore(tmp_path / "store")
    spec = BaseModelSpec.from_config_dict(json.loads((base / "config.json").read_text()))
    adapter_dir = make_peft_adapter(base, tmp_path / "a", rank=4, targets=["q_proj"], seed=3)
    adapter = load_adapter_dir(adapter_dir, base=spec, max_lora_rank=64, max_bytes=1 << 24)
    store.put(adapter)

    redis = aioredis.Redis.from_url(redis_url)
    worker = WorkerServer(
        lambda: LLMEngine(base, engine_config(dtype="float32", num_kv_blocks=64)),
        model_name=base.name,
        redis=redis,
        redis_prefix=redis_prefix,
        worker_id="obs",
        adapter_store=store.root,
    )
    settings = gateway_settings(
        redis_url=redis_url, prefix=redis_prefix, model_dir=base, store=store.root,
        served_model_name=base.name,
    )  # fmt: skip
    try:
        await worker.start()
        metrics_port = worker.metrics.start_listener(0, host="127.0.0.1")
        async with (
            running_gateway(settings) as gw,
            httpx.AsyncClient(base_url=gw.url, headers=gw.admin_headers, timeout=30) as admin,
        ):
            await admin.post("/admin/tenants", json={"name": "obs"})
            key = (await admin.post("/admin/tenants/obs/keys")).json()["key"]
            await admin.post(
                "/admin/tenants/obs/adapters", json={"name": "qa", "path": str(adapter_dir)}
            )
            headers = {"Authorization": f"Bearer {key}"}
            async with httpx.AsyncClient(base_url=gw.url, headers=headers, timeout=30) as client:
                body = {"model": "qa", "prompt": "hello", "max_tokens": 5, "ignore_eos": True}
                started = time.monotonic()
                reply = await client.post("/v1/completions", json=body)
                elapsed = time.monotonic() - started
                assert reply.status_code == 200, reply.text
            request_id = reply.json()["id"]
            fleet = await fleet_holding(admin, adapter.id)
            async with httpx.AsyncClient() as scraper:
                text = (await scraper.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    finally:
        await worker.shutdown(drain_timeout=2.0)
        await redis.aclose()
        await delete_prefix(redis_url, redis_prefix)

    # The admin's fleet: the adapter in a device slot and in the host cache, each content id
    # named for its tenant, and the engine's service for the tenant (its Stats).
    (record,) = fleet
    assert record["worker_id"] == "obs" and record["adapters"] == [adapter.id]
    assert adapter.id in record["slot_adapters"] and record["host_adapters"] == [adapter.id]
    assert record["host_cache_bytes"] == adapter.num_bytes <= record["host_cache_limit"]
    assert record["adapter_names"] == {adapter.id: ["obs/qa"]}
    (service,) = record["tenant_service"]
    assert service["tenant"] == "obs" and service["decode_tokens"] == 4

    values = scrape(text)
    assert values[("switchboard_worker_requests_total", (("outcome", "ok"),))] == 1
    assert values[("switchboard_worker_generated_tokens_total", ())] == 5
    assert values[("switchboard_worker_adapter_loads_total", (("outcome", "ok"),))] == 1
    assert values[("switchboard_worker_adapter_load_seconds_count", ())] == 1
    assert values[("switchboard_worker_adapters_loaded", ())] == 1
    assert values[("switchboard_worker_kv_blocks_total", ())] == 64
    assert values[("switchboard_worker_running_sequences", ())] == 0
    assert values[("switchboard_worker_prefix_cache_queries_total", ())] > 0
    # Fair scheduling per tenant: the prompt and 4 fed-back tokens, one admission.
    prompt_tokens = reply.json()["usage"]["prompt_tokens"]
    tenant = (("kind", "prefill"), ("tenant", "obs"))
    assert values[("switchboard_worker_tenant_service_tokens_total", tenant)] == prompt_tokens
    tenant = (("kind", "decode"), ("tenant", "obs"))
    assert values[("switchboard_worker_tenant_service_tokens_total", tenant)] == 4
    assert values[("switchboard_worker_tenant_queue_seconds_count", (("tenant", "obs"),))] == 1
    # The engine's own time to the first token: one request, within the request's own time.
    first = (("tenant", "obs"),)
    assert values[("switchboard_worker_tenant_first_token_seconds_count", first)] == 1
    assert 0 < values[("switchboard_worker_tenant_first_token_seconds_sum", first)] < elapsed
    assert values[("switchboard_worker_tenant_weight", (("tenant", "obs"),))] > 0

    # The same id on the gateway's line and the worker's line for this request.
    every = json_logs()
    mine = [line for line in every if line.get("request_id") == request_id]
    loggers = {line["logger"] for line in mine}
    assert {"gateway.metrics", "worker.serving.servicer"} <= loggers, mine
    worker_line = next(line for line in mine if line["logger"] == "worker.serving.servicer")
    assert "ok: " in worker_line["message"] and "5 generated" in worker_line["message"]
    assert {"time", "level", "message"} <= set(worker_line)


def test_speculation_counters_are_exported_when_it_is_on():
    from worker.engine.engine_stats import EngineStats
    from worker.serving.metrics import EngineStatsCollector
    from worker.spec_decode.stats import SpecDecodeStats

    spec = SpecDecodeStats()
    spec.record(num_proposed=4, num_accepted=2)
    spec.record(num_proposed=4, num_accepted=4)
    base = {"running": 0, "waiting": 0, "free_kv_blocks": 1, "total_kv_blocks": 1}

    def samples(stats: EngineStats) -> list:
        return [s for f in EngineStatsCollector(lambda: stats).collect() for s in f.samples]

    assert not [s for s in samples(EngineStats(**base, adapter_ids=())) if "spec" in s.name]
    on = samples(EngineStats(**base, adapter_ids=(), spec_decode=spec))
    totals = {s.name: s.value for s in on if not s.labels}
    assert totals["switchboard_worker_spec_proposed_tokens_total"] == 8
    assert totals["switchboard_worker_spec_accepted_tokens_total"] == 6
    assert totals["switchboard_worker_spec_emitted_tokens_total"] == 8
    by_position = {
        int(s.labels["position"]): s.value
        for s in on
        if s.name == "switchboard_worker_spec_accepted_by_position_total"
    }
    assert by_position == {0: 2, 1: 2, 2: 1, 3: 1}
