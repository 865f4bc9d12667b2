"""The gateway's /metrics: Prometheus text with the switchboard_… series a dashboard needs,
moving as requests succeed, fail, stream and get refused; on the HTTP port for the admin
only (labels name every tenant and adapter), without auth on the separate metrics port."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway_support import (
    MODEL_NAME,
    Mode,
    create_tenant_key,
    delete_prefix,
    gateway_settings,
    gateway_with_worker,
    running_gateway,
)
from runtime.embedded_redis import free_port

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}


def family_names(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


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
        admin = live.gw.admin_headers
        async with httpx.AsyncClient(base_url=live.gw.url, headers=headers) as client:
            before = samples((await client.get("/metrics", headers=admin)).text)
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
            text = (await client.get("/metrics", headers=admin)).text
    after = samples(text)

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    requests = "switchboard_requests_total"
    ok = {"tenant": "metered", "model": MODEL_NAME, "endpoint": "chat"}
    assert delta(requests, **ok, status="200") == 3
    assert delta(requests, **ok, status="502") == 1  # failed mid-stream
    assert delta(requests, **ok, status="429") == 1
    # A model name the gateway did not resolve is no label value of its own.
    assert (
        delta(requests, tenant="metered", model="unknown", endpoint="completions", status="404")
        == 1
    )
    assert not [key for key in after if ("model", "nope") in key[1]]
    assert delta("switchboard_quota_rejections_total", tenant="metered", reason="requests") == 1
    assert delta("switchboard_time_to_first_token_seconds_count") == 4
    assert delta("switchboard_inter_token_latency_seconds_count") > 0
    assert delta("switchboard_request_duration_seconds_count", endpoint="chat") == 5
    # The gateway's own share: admission once per request that reached a worker (the 404 and
    # the 429 did not), relay once per streamed text delta.
    added = "switchboard_gateway_added_seconds"
    assert delta(f"{added}_count", phase="admission") == 4
    assert delta(f"{added}_count", phase="relay") > 0
    # Admission ends with the worker call, before its first token: within each request's TTFT.
    ttft_sum = delta("switchboard_time_to_first_token_seconds_sum")
    assert 0 < delta(f"{added}_sum", phase="admission") <= ttft_sum
    assert after[("switchboard_requests_in_flight", ())] == 0


async def test_client_chosen_names_leave_the_number_of_series_bounded(
    redis_url, redis_prefix, model_dir, tmp_path
):
    """1,000 requests naming random models (chat and completions, with and without a
    stream) and random paths add a fixed handful of series, whatever the names."""
    import random
    import string

    settings = gateway_settings(
        redis_url=redis_url, prefix=redis_prefix, model_dir=model_dir, store=tmp_path / "s"
    )
    rng = random.Random(27)

    def name() -> str:
        return "".join(rng.choices(string.ascii_letters + string.digits + "-_.:/", k=12))

    async with gateway_with_worker(settings, tenants=("prober",)) as live:
        headers = {"Authorization": f"Bearer {live.keys['prober']}"}
        admin = live.gw.admin_headers
        async with httpx.AsyncClient(base_url=live.gw.url, headers=headers) as client:
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            before = samples((await client.get("/metrics", headers=admin)).text)
            names = []
            for i in range(1000):
                names.append(name())
                if i % 4 == 3:
                    reply = await client.get(f"/v1/{names[-1]}")
                elif i % 2:
                    body = {"model": names[-1], "prompt": "x", "stream": i % 3 == 0}
                    reply = await client.post("/v1/completions", json=body)
                else:
                    body = {**CHAT, "model": names[-1]}
                    reply = await client.post("/v1/chat/completions", json=body)
                assert reply.status_code == 404, reply.text
            after = samples((await client.get("/metrics", headers=admin)).text)
    label_values = {value for _, labels in after for _, value in labels}
    assert not label_values & set(names)
    new_series = set(after) - set(before)
    assert len(new_series) <= 8, sorted(new_series)


async def test_arrival_is_stamped_before_the_app_parses_anything():
    """The admission phase starts when the ASGI call arrives (StampArrival), so parsing and
    validation count as the gateway's time; other scope types are passed through as is."""
    import time

    from starlette.requests import Request

    from gateway.app import StampArrival
    from gateway.connection import arrival_of

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


@pytest.fixture
def settings_for(redis_url, redis_prefix, model_dir, tmp_path):
    """Gateway settings on this test's Redis prefix (its keys are deleted afterwards)."""
    yield lambda **overrides: gateway_settings(
        redis_url=redis_url,
        prefix=redis_prefix,
        model_dir=model_dir,
        store=tmp_path / "store",
        **overrides,
    )


@pytest.fixture(autouse=True)
async def _delete_test_keys(redis_url, redis_prefix):
    yield
    await delete_prefix(redis_url, redis_prefix)


def assert_admin_refusal(response: httpx.Response) -> None:
    """401 in OpenAI's error format, as the admin API answers."""
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_admin_token")


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer not-the-admin-token"}, {"Authorization": "Basic abc"}],
    ids=["none", "wrong", "not-bearer"],
)
async def test_metrics_on_the_http_port_need_the_admin_token(settings_for, headers):
    async with (
        running_gateway(settings_for()) as gw,
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        assert_admin_refusal(await client.get("/metrics", headers=headers))
        # A tenant's own API key is no better: the labels name every other tenant.
        tenant = {"Authorization": f"Bearer {await create_tenant_key(gw, 'acme')}"}
        assert_admin_refusal(await client.get("/metrics", headers=tenant))
        allowed = await client.get("/metrics", headers=gw.admin_headers)
    assert allowed.status_code == 200
    assert allowed.headers["content-type"].startswith("text/plain")
    assert "switchboard_requests_in_flight" in family_names(allowed.text)


async def test_every_exported_name_is_in_the_switchboard_namespace(settings_for):
    async with (
        running_gateway(settings_for()) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=gw.admin_headers) as client,
    ):
        names = family_names((await client.get("/metrics")).text)
    assert names and all(name.startswith("switchboard_") for name in names), sorted(names)
    # No process_/python_ series from prometheus_client's default registry; RSS and CPU come
    # from a ProcessCollector in our namespace (it reads /proc: Linux only).
    if Path("/proc/self/stat").exists():
        assert {
            "switchboard_gateway_process_resident_memory_bytes",
            "switchboard_gateway_process_cpu_seconds",
        } <= names


async def test_metrics_port_serves_the_same_series_without_auth(settings_for):
    port = free_port()
    async with (
        running_gateway(settings_for(metrics_port=port)) as gw,
        httpx.AsyncClient() as client,
    ):
        scraped = await client.get(f"http://127.0.0.1:{port}/metrics")  # no Authorization
        main = await client.get(f"{gw.url}/metrics", headers=gw.admin_headers)
    assert scraped.status_code == 200
    assert family_names(scraped.text) == family_names(main.text)
    assert all(name.startswith("switchboard_") for name in family_names(scraped.text))
    # Stopping the app stops the listener and frees its port.
    with socket.create_server(("127.0.0.1", port)):
        pass


async def test_metrics_port_zero_takes_a_free_port_per_app(settings_for):
    """Several apps in one process (tests) each get a listener of their own, closed with the
    app; the bound port is on `app.state.metrics_port` (and logged)."""
    apps = [create_app(settings_for(metrics_port=0)) for _ in range(2)]
    async with (
        apps[0].router.lifespan_context(apps[0]),
        apps[1].router.lifespan_context(apps[1]),
        httpx.AsyncClient() as client,
    ):
        ports = [app.state.metrics_port for app in apps]
        assert len(set(ports)) == 2 and 0 not in ports
        for port in ports:
            reply = await client.get(f"http://127.0.0.1:{port}/metrics")
            assert reply.status_code == 200
            assert "switchboard_requests_in_flight" in family_names(reply.text)
    for port in ports:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_metrics_port_is_off_unless_set(monkeypatch):
    from gateway.settings import GatewaySettings
    from switchboard.cli import build_parser

    monkeypatch.delenv("SWITCHBOARD_METRICS_PORT", raising=False)
    assert GatewaySettings(dev_mode=True).metrics_port is None
    assert build_parser().parse_args(["gateway"]).metrics_port is None  # the env decides
    monkeypatch.setenv("SWITCHBOARD_METRICS_PORT", "9401")
    assert GatewaySettings(dev_mode=True).metrics_port == 9401
    assert build_parser().parse_args(["gateway", "--metrics-port=0"]).metrics_port == 0
