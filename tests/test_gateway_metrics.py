"""The gateway's /metrics: Prometheus text with the switchboard_… series a dashboard needs,
moving as requests succeed, fail, stream and get refused."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.test_gateway_support import (
    MODEL_NAME,
    Mode,
    gateway_settings,
    gateway_with_worker,
)

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_follow_requests(redis_url, redis_prefix, model_dir, tmp_path):
    settings = gateway_settings(
        redis_url=redis_url, prefix=redis_prefix, model_dir=model_dir, store=tmp_path / "s"
    )
    async with gateway_with_worker(settings, tenants=("metered",)) as live:
        headers = {"Authorization": f"Bearer {live.keys['metered']}"}
        async with httpx.AsyncClient(base_url=live.gw.url, headers=headers) as client:
            before = samples((await client.get("/metrics")).text)
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            assert streamed.status_code == 200
            missing = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
            assert missing.status_code == 404
            live.worker.mode = Mode.FAIL_MID_STREAM
            failed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            assert '"error"' in failed.text
            await client.put(
                "/admin/tenants/metered/quotas",
                json={"requests_per_minute": 1},
                headers=live.gw.admin_headers,
            )
            live.worker.mode = Mode.OK
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 429
            text = (await client.get("/metrics")).text
    after = samples(text)

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    requests = "switchboard_requests_total"
    ok = {"tenant": "metered", "model": MODEL_NAME, "endpoint": "chat"}
    assert delta(requests, **ok, status="200") == 3
    assert delta(requests, **ok, status="502") == 1  # failed mid-stream
    assert delta(requests, **ok, status="429") == 1
    assert (
        delta(requests, tenant="metered", model="nope", endpoint="completions", status="404") == 1
    )
    assert delta("switchboard_quota_rejections_total", tenant="metered", reason="requests") == 1
    assert delta("switchboard_time_to_first_token_seconds_count") == 4
    assert delta("switchboard_inter_token_latency_seconds_count") > 0
    assert delta("switchboard_request_duration_seconds_count", endpoint="chat") == 5
    # The gateway's own share: admission once per request that reached a worker (the 404 and
    # the 429 did not), relay once per streamed text delta.
    added = "switchboard_gateway_added_seconds"
    assert delta(f"{added}_count", phase="admission") == 4
    assert delta(f"{added}_count", phase="relay") > 0
    assert delta(f"{added}_sum", phase="admission") < 4 * 0.25  # seconds, in a test: generous
    assert after[("switchboard_requests_in_flight", ())] == 0


async def test_arrival_is_stamped_before_the_app_parses_anything():
    """The admission phase starts when the ASGI call arrives (StampArrival), so parsing and
    validation count as the gateway's time; other scope types are passed through as is."""
    import time

    from starlette.requests import Request

    from gateway.app import StampArrival
    from gateway.serving import arrival_of

    seen = []

    async def app(scope, receive, send):
        seen.append(scope)

    before = time.monotonic()
    await StampArrival(app)({"type": "http", "headers": []}, None, None)
    await StampArrival(app)({"type": "lifespan"}, None, None)
    http, lifespan = seen
    assert before <= http["state"]["arrived"] <= time.monotonic()
    assert arrival_of(Request(http)) == http["state"]["arrived"]
    assert "state" not in lifespan
