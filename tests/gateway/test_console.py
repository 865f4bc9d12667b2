"""The web console over plain HTTP (real gateway, real Redis): sign-in, the session cookie,
CSRF and origin checks, and the bridge that answers the pages' calls with the API's own routes.
The browser tests (tests/e2e/test_console_browser.py) drive the same pages in Chromium."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import uvicorn

from archive_factories import adapter_members, tar_bytes
from gateway.app import create_app
from gateway_support import (
    ADMIN_TOKEN,
    archive_upload,
    assert_error,
    delete_prefix,
    gateway_settings,
    gateway_with_worker,
    write_adapter,
)

MAX_UPLOAD = 1 << 20


@pytest.fixture
async def live(redis_url, redis_prefix, model_dir, tmp_path):
    settings = gateway_settings(
        redis_url=redis_url,
        prefix=redis_prefix,
        model_dir=model_dir,
        store=tmp_path / "store",
        max_upload_bytes=MAX_UPLOAD,
        max_lora_rank=8,
    )
    async with gateway_with_worker(settings, tenants=("alice", "bob")) as gateway:
        yield gateway


def client(live) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=live.gw.url, timeout=30)


async def sign_in(http: httpx.AsyncClient, credential: str, *, side: str = "/console") -> str:
    """Signs in; returns the page's CSRF token (the cookie stays in the client's jar)."""
    answer = await http.post(f"{side}/login", data={"credential": credential})
    assert answer.status_code == 303, answer.text
    page = await http.get(side)
    assert page.status_code == 200, page.text
    return re.search(r'name="csrf-token" content="([0-9a-f]+)"', page.text).group(1)


async def test_sign_in_sets_an_httponly_strict_cookie_and_the_page_its_headers(live):
    async with client(live) as http:
        assert (await http.get("/console")).headers["location"] == "/console/login"
        answer = await http.post("/console/login", data={"credential": live.keys["alice"]})
        cookie = answer.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
        page = await http.get("/console")
        assert page.status_code == 200 and ">alice<" in page.text
        assert live.keys["alice"] not in page.text  # the secret is never in the page
        policy = page.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
        assert page.headers["x-frame-options"] == "DENY"
        assert page.headers["cache-control"] == "no-store"


@pytest.mark.parametrize("credential", ["sk-not-a-key", ADMIN_TOKEN, ""])
async def test_a_wrong_key_gets_the_apis_words(live, credential):
    async with client(live) as http:
        answer = await http.post("/console/login", data={"credential": credential})
        assert answer.status_code == 401 and "set-cookie" not in answer.headers
        assert "API key" in answer.text


async def test_the_bridge_answers_with_the_apis_routes_and_needs_the_csrf_token(live):
    async with client(live) as http:
        csrf = await sign_in(http, live.keys["alice"])
        listed = await http.get("/console/api/adapters", headers={"x-csrf-token": csrf})
        assert listed.status_code == 200 and listed.json() == {"object": "list", "data": []}
        assert "content-security-policy" in listed.headers
        for headers in ({}, {"x-csrf-token": "0" * 64}):
            refused = await http.get("/console/api/adapters", headers=headers)
            assert_error(refused, 403, code="csrf_failed")
        # Another site's page: its origin (or the browser's verdict) is refused, token or not.
        for other in ({"origin": "http://evil.example"}, {"sec-fetch-site": "cross-site"}):
            refused = await http.get("/console/api/models", headers={"x-csrf-token": csrf, **other})
            assert_error(refused, 403, code="csrf_failed")
        # Only the API's tenant routes are behind the tenant bridge.
        for path in ("/console/api/../admin/tenants", "/console/api//admin/tenants"):
            request = http.build_request("GET", path, headers={"x-csrf-token": csrf})
            request.url = request.url.copy_with(raw_path=path.encode())
            assert (await http.send(request)).status_code == 404


async def test_a_cross_site_form_post_changes_nothing(live, tmp_path):
    """A form on another site posting to the bridge: the browser sends the cookie
    (SameSite aside), but neither the token nor our origin."""
    adapter = write_adapter(tmp_path / "sql")
    upload = archive_upload("sql", tar_bytes(adapter_members(adapter, folder="sql")))
    async with client(live) as http:
        await sign_in(http, live.keys["alice"])
        forged = await http.post(
            "/console/api/adapters", **upload, headers={"origin": "http://evil.example"}
        )
        assert_error(forged, 403, code="csrf_failed")
        forged = await http.post("/console/api/adapters", **upload)  # no token
        assert_error(forged, 403, code="csrf_failed")
        login = await http.post(
            "/console/login",
            data={"credential": live.keys["bob"]},
            headers={"origin": "http://evil.example"},
        )
        assert login.status_code == 403 and "set-cookie" not in login.headers
    assert await live.redis.hkeys(f"{live.prefix}tenant:alice:adapters") == []


async def test_uploads_through_the_console_meet_the_apis_limits_and_scopes(live, tmp_path):
    adapter = write_adapter(tmp_path / "sql")
    upload = archive_upload("sql", tar_bytes(adapter_members(adapter, folder="sql")))
    async with client(live) as alice, client(live) as bob:
        token = await sign_in(alice, live.keys["alice"])
        created = await alice.post(
            "/console/api/adapters", **upload, headers={"x-csrf-token": token}
        )
        assert created.status_code == 201, created.text
        huge = archive_upload("big", b"\0" * (MAX_UPLOAD + 1))
        refused = await alice.post("/console/api/adapters", **huge, headers={"x-csrf-token": token})
        assert_error(refused, 413, code="payload_too_large")
        # Bob's console sees none of alice's: her name answers exactly like a missing one.
        bob_token = await sign_in(bob, live.keys["bob"])
        headers = {"x-csrf-token": bob_token}
        assert (await bob.get("/console/api/adapters", headers=headers)).json()["data"] == []
        theirs = await bob.get("/console/api/adapters/sql", headers=headers)
        missing = await bob.get("/console/api/adapters/nothing", headers=headers)
        assert theirs.status_code == missing.status_code == 404
        assert (
            theirs.json()["error"]["message"].replace("sql", "nothing")
            == (missing.json()["error"]["message"])
        )
        deleted = await bob.delete("/console/api/adapters/sql", headers=headers)
        assert deleted.status_code == 404
    assert await live.redis.hkeys(f"{live.prefix}tenant:alice:adapters") == ["sql"]


async def test_a_revoked_key_is_signed_out(live):
    async with client(live) as http, httpx.AsyncClient(base_url=live.gw.url) as admin:
        csrf = await sign_in(http, live.keys["alice"])
        key_id = (await http.get("/console/api/usage", headers={"x-csrf-token": csrf})).status_code
        assert key_id == 200
        keys = await live.redis.smembers(f"{live.prefix}tenant:alice:keys")
        for key in keys:
            revoked = await admin.delete(f"/admin/keys/{key}", headers=live.gw.admin_headers)
            assert revoked.status_code == 200
        call = await http.get("/console/api/usage", headers={"x-csrf-token": csrf})
        assert_error(call, 401, code="invalid_api_key")
        page = await http.get("/console")
        assert page.status_code == 303 and page.headers["location"] == "/console/login?expired=1"
        assert 'sb_console=""' in page.headers["set-cookie"]


async def test_the_admin_side_takes_only_the_admin_token(live):
    async with client(live) as http:
        refused = await http.post("/console/admin/login", data={"credential": live.keys["alice"]})
        assert refused.status_code == 401
        # A tenant's session is no admin session, even with its own CSRF token.
        csrf = await sign_in(http, live.keys["alice"])
        call = await http.get("/console/admin/api/tenants", headers={"x-csrf-token": csrf})
        assert_error(call, 401, code="invalid_admin_token")
        admin_csrf = await sign_in(http, ADMIN_TOKEN, side="/console/admin")
        tenants = await http.get("/console/admin/api/tenants", headers={"x-csrf-token": admin_csrf})
        assert [t["name"] for t in tenants.json()["data"]] == ["alice", "bob"]
        # The admin's session is no tenant session either.
        http.cookies.delete("sb_console")
        call = await http.get("/console/api/models", headers={"x-csrf-token": admin_csrf})
        assert_error(call, 401, code="invalid_api_key")


async def test_sign_out_needs_the_token(live):
    async with client(live) as http:
        csrf = await sign_in(http, live.keys["alice"])
        forged = await http.post("/console/logout", data={})
        assert forged.status_code == 403
        done = await http.post("/console/logout", data={"csrf_token": csrf})
        assert done.status_code == 303 and 'sb_console=""' in done.headers["set-cookie"]


@pytest.mark.parametrize("admin", ["own_port", "off"])
async def test_the_admin_console_goes_where_the_admin_api_goes(
    redis_url, redis_prefix, model_dir, tmp_path, admin
):
    extra = {"admin_port": 0, "admin_host": "127.0.0.1"} if admin == "own_port" else {}
    settings = gateway_settings(
        redis_url=redis_url,
        prefix=redis_prefix,
        model_dir=model_dir,
        store=tmp_path / "store",
        admin_api=admin != "off",
        **extra,
    )
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            assert (await http.get("/console/admin/login")).status_code == 404
            assert (await http.get("/console/login")).status_code == 200
        if admin == "own_port":
            admin_url = f"http://127.0.0.1:{app.state.admin_port}"
            async with httpx.AsyncClient(base_url=admin_url) as side:
                assert (await side.get("/console/login")).status_code == 404
                csrf = await sign_in(side, ADMIN_TOKEN, side="/console/admin")
                headers = {"x-csrf-token": csrf}
                listed = await side.get("/console/admin/api/tenants", headers=headers)
                assert listed.status_code == 200 and listed.json() == {"data": []}
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=10)
        await delete_prefix(redis_url, redis_prefix)


async def test_the_tenants_page_shows_its_batches_through_the_api(live):
    """The page carries the batches section; its calls (upload, start, list, download) are the
    API's through the bridge, scoped to the tenant; the lines reach the worker in the batch
    band, the chat beside them in the interactive one."""
    from rpc import worker_pb2

    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}
    line = {"custom_id": "one", "method": "POST", "url": "/v1/chat/completions", "body": body}
    async with client(live) as alice, client(live) as bob:
        token = await sign_in(alice, live.keys["alice"])
        headers = {"x-csrf-token": token}
        page = await alice.get("/console")
        assert 'id="batches"' in page.text and "batches.js" in page.text
        assert (await alice.get("/console/static/batches.js")).status_code == 200
        uploaded = await alice.post(
            "/console/api/files", headers=headers, data={"purpose": "batch"},
            files={"file": ("in.jsonl", (json.dumps(line) + "\n").encode())},
        )  # fmt: skip
        assert uploaded.status_code == 200, uploaded.text
        started = await alice.post(
            "/console/api/batches", headers=headers, json={
                "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h"},
        )  # fmt: skip
        assert started.status_code == 200, started.text
        batch_id = started.json()["id"]
        for _ in range(200):
            batch = (await alice.get(f"/console/api/batches/{batch_id}", headers=headers)).json()
            if batch["status"] == "completed":
                break
            await asyncio.sleep(0.05)
        assert batch["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
        listed = await alice.get("/console/api/batches?limit=100", headers=headers)
        assert [b["id"] for b in listed.json()["data"]] == [batch_id]
        output = await alice.get(
            f"/console/api/files/{batch['output_file_id']}/content", headers=headers
        )
        (row,) = [json.loads(x) for x in output.text.splitlines()]
        assert row["custom_id"] == "one" and row["response"]["status_code"] == 200
        bob_headers = {"x-csrf-token": await sign_in(bob, live.keys["bob"])}
        assert (await bob.get("/console/api/batches", headers=bob_headers)).json()["data"] == []
        theirs = await bob.get(f"/console/api/batches/{batch_id}", headers=bob_headers)
        assert theirs.status_code == 404
    assert [r.priority for r in live.worker.requests] == [worker_pb2.PRIORITY_BATCH]
