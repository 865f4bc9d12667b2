"""The admin API, tenants and API keys, adapter registration and /v1/models, over real Redis
and a real uvicorn server."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.errors import AuthenticationError
from gateway.main import skip_observed_access_lines
from gateway.tenancy.tenants import TenantStore
from gateway_support import (
    ADMIN_TOKEN,
    MODEL_NAME,
    delete_prefix,
    gateway_settings,
    gateway_with_worker,
    running_gateway,
    write_adapter,
)


class Clock:
    """The key cache's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def until(condition, timeout_s: float = 10.0) -> None:
    """Wait for a background task's effect (a hang guard, not a timing check)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.01)


@pytest.fixture
async def gw(redis_url, redis_prefix, model_dir, tmp_path):
    settings = gateway_settings(
        redis_url=redis_url, prefix=redis_prefix, model_dir=model_dir, store=tmp_path / "store"
    )
    async with running_gateway(settings) as gateway:
        yield gateway
    await delete_prefix(redis_url, redis_prefix)


@pytest.fixture
async def admin(gw):
    async with httpx.AsyncClient(base_url=gw.url, headers=gw.admin_headers) as client:
        yield client


@pytest.fixture
async def redis_client(redis_url, redis_prefix):
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


async def new_key(admin: httpx.AsyncClient, tenant: str) -> dict:
    created = await admin.post("/admin/tenants", json={"name": tenant})
    assert created.status_code == 201, created.text
    key = await admin.post(f"/admin/tenants/{tenant}/keys")
    assert key.status_code == 201, key.text
    return key.json()


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong-token"}, {"Authorization": ADMIN_TOKEN}],
    ids=["missing", "wrong", "not-bearer"],
)
async def test_admin_api_requires_the_admin_token(gw, headers):
    async with httpx.AsyncClient(base_url=gw.url, headers=headers) as client:
        for method, path in [("GET", "/admin/tenants"), ("POST", "/admin/tenants/a/keys")]:
            response = await client.request(method, path)
            assert_openai_error(response, 401, "invalid_admin_token")


async def test_tenant_key_lifecycle(admin, gw, redis_client, redis_prefix):
    key = await new_key(admin, "acme")
    assert key["key"].startswith("sk-") and len(key["key"]) >= 3 + 43  # 32 bytes urlsafe
    assert key["key_id"].startswith("key_") and key["tenant"] == "acme"
    listed = (await admin.get("/admin/tenants")).json()["data"]
    assert [t["name"] for t in listed] == ["acme"]
    assert_openai_error(await admin.post("/admin/tenants", json={"name": "acme"}), 409)

    user = {"Authorization": f"Bearer {key['key']}"}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        models = await client.get("/v1/models", headers=user)
        assert models.status_code == 200
        assert [m["id"] for m in models.json()["data"]] == [MODEL_NAME]

        # Redis holds only the hash: no value or key name contains the raw key.
        async for name in redis_client.scan_iter(match=f"{redis_prefix}*"):
            assert key["key"] not in name
            kind = await redis_client.type(name)
            if kind == "string":
                values = [await redis_client.get(name)]
            elif kind == "hash":
                values = [*(await redis_client.hgetall(name)).items()]
            else:
                values = list(await redis_client.smembers(name))
            assert key["key"] not in json.dumps(values)

        revoked = await admin.delete(f"/admin/keys/{key['key_id']}")
        assert revoked.status_code == 200
        assert_openai_error(await client.get("/v1/models", headers=user), 401, "invalid_api_key")
        assert_openai_error(await admin.delete(f"/admin/keys/{key['key_id']}"), 404)


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer sk-not-a-real-key"}, {"Authorization": "Basic abc"}],
    ids=["missing", "unknown", "not-bearer"],
)
async def test_api_requires_a_valid_key(gw, headers):
    async with httpx.AsyncClient(base_url=gw.url, headers=headers) as client:
        assert_openai_error(await client.get("/v1/models"), 401, "invalid_api_key")
        body = {"model": MODEL_NAME, "prompt": "hi"}
        assert_openai_error(await client.post("/v1/completions", json=body), 401)


async def test_keys_for_unknown_tenant_and_bad_names(admin):
    assert_openai_error(await admin.post("/admin/tenants/nobody/keys"), 404)
    assert_openai_error(await admin.post("/admin/tenants", json={"name": "Bad Name!"}), 400)
    assert_openai_error(await admin.post("/admin/tenants", json={}), 422, "invalid_value")


async def test_adapters_are_tenant_scoped(admin, gw, tmp_path):
    alice = await new_key(admin, "alice")
    bob = await new_key(admin, "bob")
    path = write_adapter(tmp_path / "sql-adapter")
    registered = await admin.post(
        "/admin/tenants/alice/adapters", json={"name": "sql", "path": str(path)}
    )
    assert registered.status_code == 201, registered.text
    record = registered.json()
    assert len(record["adapter_id"]) == 64
    assert (gw.settings.adapter_store / record["adapter_id"] / "adapter_config.json").is_file()
    assert (record["rank"], record["target_modules"]) == (4, ["q_proj", "v_proj"])
    listed = (await admin.get("/admin/tenants/alice/adapters")).json()["data"]
    assert [(a["name"], a["version"]) for a in listed] == [("sql", 1)]

    async with httpx.AsyncClient(base_url=gw.url) as client:
        as_alice = {"Authorization": f"Bearer {alice['key']}"}
        as_bob = {"Authorization": f"Bearer {bob['key']}"}
        alice_models = (await client.get("/v1/models", headers=as_alice)).json()["data"]
        assert [m["id"] for m in alice_models] == [MODEL_NAME, "sql"]
        sql = alice_models[1]
        assert sql["parent"] == MODEL_NAME and sql["root"] == record["adapter_id"]
        bob_models = (await client.get("/v1/models", headers=as_bob)).json()["data"]
        assert [m["id"] for m in bob_models] == [MODEL_NAME]

        # Bob asking for Alice's adapter gets exactly what a nonexistent name gets.
        foreign = await client.post(
            "/v1/completions", headers=as_bob, json={"model": "sql", "prompt": "x"}
        )
        missing = await client.post(
            "/v1/completions", headers=as_bob, json={"model": "nope", "prompt": "x"}
        )
        assert_openai_error(foreign, 404, "model_not_found")
        assert_openai_error(missing, 404, "model_not_found")
        assert foreign.json()["error"]["message"].replace("sql", "X") == missing.json()["error"][
            "message"
        ].replace("nope", "X")

        # One entry (the SDK's models.retrieve): the caller's own, never another tenant's.
        assert (await client.get("/v1/models/sql", headers=as_alice)).json() == sql
        base = (await client.get(f"/v1/models/{MODEL_NAME}", headers=as_bob)).json()
        assert base == alice_models[0]
        assert_openai_error(
            await client.get("/v1/models/sql", headers=as_bob), 404, "model_not_found"
        )
        assert_openai_error(
            await client.get("/v1/models/nope", headers=as_bob), 404, "model_not_found"
        )
        assert_openai_error(await client.get("/v1/models/sql"), 401, "invalid_api_key")

    removed = await admin.delete("/admin/tenants/alice/adapters/sql")
    assert removed.status_code == 200 and removed.json()["content_deleted"] is True
    assert (await admin.get("/admin/tenants/alice/adapters")).json()["data"] == []
    assert not (gw.settings.adapter_store / record["adapter_id"]).exists()


async def test_adapter_registration_errors(admin, tmp_path):
    await admin.post("/admin/tenants", json={"name": "carol"})
    bad = write_adapter(tmp_path / "too-big", rank=8)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_qalora": True}))
    refused = await admin.post(
        "/admin/tenants/carol/adapters", json={"name": "qalora", "path": str(bad)}
    )
    error = assert_openai_error(refused, 400)
    assert "use_qalora" in error["message"]
    missing = await admin.post(
        "/admin/tenants/carol/adapters", json={"name": "x", "path": str(tmp_path / "absent")}
    )
    assert_openai_error(missing, 400)
    good = write_adapter(tmp_path / "good")
    body = {"name": MODEL_NAME, "path": str(good)}
    assert_openai_error(await admin.post("/admin/tenants/carol/adapters", json=body), 400)
    body = {"name": "ok", "path": str(good)}
    first = await admin.post("/admin/tenants/carol/adapters", json=body)
    assert first.status_code == 201
    # The same content under the same name again is the same record (idempotent); other
    # content under it is a conflict.
    again = await admin.post("/admin/tenants/carol/adapters", json=body)
    assert again.json() == first.json()
    other = {"name": "ok", "path": str(write_adapter(tmp_path / "other", seed=3))}
    assert_openai_error(await admin.post("/admin/tenants/carol/adapters", json=other), 409)


async def test_admin_cli_wraps_the_api(gw, tmp_path, capsys):
    from switchboard.cli import main

    def cli(*words: str) -> tuple[int, str]:
        status = main([*words, "--url", gw.url, "--admin-token", ADMIN_TOKEN])
        captured = capsys.readouterr()
        return status, captured.out + captured.err

    # The CLI is synchronous (httpx); the gateway runs in this loop, so call it from a thread.
    status, out = await asyncio.to_thread(cli, "admin", "tenants", "create", "dave")
    assert status == 0 and json.loads(out)["name"] == "dave"
    status, out = await asyncio.to_thread(cli, "admin", "keys", "create", "dave")
    key = json.loads(out)
    assert status == 0 and key["key"].startswith("sk-")
    path = str(write_adapter(tmp_path / "a"))
    status, out = await asyncio.to_thread(cli, "admin", "adapters", "register", "dave", "a", path)
    assert status == 0 and len(json.loads(out)["adapter_id"]) == 64
    status, out = await asyncio.to_thread(cli, "admin", "tenants", "list")
    assert [t["name"] for t in json.loads(out)["data"]] == ["dave"]
    status, _ = await asyncio.to_thread(cli, "admin", "keys", "revoke", key["key_id"])
    assert status == 0
    status, out = await asyncio.to_thread(cli, "admin", "keys", "revoke", key["key_id"])
    assert status == 1 and "error 404" in out
    status, out = await asyncio.to_thread(
        cli, "admin", "quotas", "set", "dave", "--requests-per-minute", "60", "--daily-tokens", "9",
        "--max-adapters", "3",
    )  # fmt: skip
    assert status == 0
    assert json.loads(out) == {
        "tenant": "dave",
        "requests_per_minute": 60,
        "tokens_per_minute": None,
        "max_concurrent_requests": None,
        "daily_tokens": 9,
        "max_adapters": 3,
        "max_adapter_bytes": None,
    }
    status, out = await asyncio.to_thread(cli, "admin", "quotas", "get", "dave")
    assert status == 0 and json.loads(out)["requests_per_minute"] == 60
    status, out = await asyncio.to_thread(cli, "admin", "usage", "--tenant", "dave")
    assert status == 0 and json.loads(out) == {"object": "list", "data": []}


async def test_a_key_revoked_through_another_replica_stops_within_the_cache_time(
    redis_client, redis_prefix
):
    """Two gateway replicas' stores on one Redis: revoking through one stops the key there
    at once and on the other once its cached entry expires (api_key_cache_s)."""
    clock = Clock()
    here = TenantStore(redis_client, prefix=redis_prefix, key_cache_s=0.3, clock=clock)
    there = TenantStore(redis_client, prefix=redis_prefix, key_cache_s=0.3, clock=clock)
    uncached = TenantStore(redis_client, prefix=redis_prefix, key_cache_s=0.0, clock=clock)
    await here.create_tenant("erin")
    key = await here.create_key("erin")
    for store in (here, there, uncached):
        assert (await store.authenticate(key.key)).tenant == "erin"
    await there.revoke_key(key.key_id)
    for store in (there, uncached):
        with pytest.raises(AuthenticationError):
            await store.authenticate(key.key)
    assert (await here.authenticate(key.key)).tenant == "erin"  # its cached entry
    clock.now += 0.35
    with pytest.raises(AuthenticationError):
        await here.authenticate(key.key)


async def test_a_key_in_use_is_checked_again_before_its_entry_expires(redis_client, redis_prefix):
    """Past half of api_key_cache_s a known key is still accepted at once, and checked
    again in the background: renewed while valid, dropped once revoked elsewhere."""
    clock = Clock()
    here = TenantStore(redis_client, prefix=redis_prefix, key_cache_s=10.0, clock=clock)
    there = TenantStore(redis_client, prefix=redis_prefix, key_cache_s=10.0, clock=clock)
    await here.create_tenant("finn")
    key = await here.create_key("finn")

    await here.authenticate(key.key)
    assert here.cached_until(key.key) == 110.0
    clock.now = 106.0  # past half its life
    assert (await here.authenticate(key.key)).tenant == "finn"
    await until(lambda: here.cached_until(key.key) == 116.0)  # renewed in the background
    await there.revoke_key(key.key_id)
    clock.now = 112.0
    assert (await here.authenticate(key.key)).tenant == "finn"  # not expired yet
    await until(lambda: here.cached_until(key.key) is None)  # dropped in the background
    with pytest.raises(AuthenticationError):  # 4 s before its entry would have expired
        await here.authenticate(key.key)


async def test_access_log_skips_only_successful_generation_requests(
    redis_url, redis_prefix, model_dir, tmp_path
):
    """Through real uvicorn: its access lines for successful completions are dropped (the
    gateway's own request log has them), every other request and every error keeps one."""
    settings = gateway_settings(
        redis_url=redis_url, prefix=redis_prefix, model_dir=model_dir, store=tmp_path / "s"
    )
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    access = logging.getLogger("uvicorn.access")
    async with gateway_with_worker(settings) as live:
        level, keep, skip = access.level, Keep(), skip_observed_access_lines()
        access.setLevel(logging.INFO)  # the test server runs uvicorn at "warning"
        access.addHandler(keep)
        try:
            headers = {"Authorization": f"Bearer {live.keys['acme']}"}
            async with httpx.AsyncClient(base_url=live.gw.url, headers=headers) as client:
                body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
                assert (await client.post("/v1/completions", json=body)).status_code == 200
                missing = await client.post("/v1/completions", json={**body, "model": "nope"})
                assert missing.status_code == 404
                assert (await client.get("/v1/models")).status_code == 200
        finally:
            access.removeHandler(keep)
            access.removeFilter(skip)
            access.setLevel(level)
    assert len(lines) == 2, lines
    assert '"POST /v1/completions HTTP/1.1" 404' in lines[0]
    assert '"GET /v1/models HTTP/1.1" 200' in lines[1]
