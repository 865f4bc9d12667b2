"""GET /v1/account: a tenant's keys (ids only), its limits beside what of each is in use now
(read without admitting anything), its scheduling; nothing of another tenant's."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway_support import MODEL_NAME, gateway_settings, gateway_with_worker


@pytest.fixture
async def live(redis_url, redis_prefix, model_dir, tmp_path):
    settings = gateway_settings(
        redis_url=redis_url, prefix=redis_prefix, model_dir=model_dir, store=tmp_path / "store"
    )
    async with gateway_with_worker(settings, tenants=("alice", "bob")) as gateway:
        yield gateway


def as_tenant(live, tenant: str) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {live.keys[tenant]}"}
    return httpx.AsyncClient(base_url=live.gw.url, headers=headers, timeout=30)


async def test_limits_and_what_is_in_use_now(live):
    quota = {
        "requests_per_minute": 10,
        "tokens_per_minute": 1000,
        "max_concurrent_requests": 4,
        "daily_tokens": 5000,
    }
    async with httpx.AsyncClient(base_url=live.gw.url, headers=live.gw.admin_headers) as admin:
        assert (await admin.put("/admin/tenants/alice/quotas", json=quota)).status_code == 200
    async with as_tenant(live, "alice") as alice, as_tenant(live, "bob") as bob:
        before = (await alice.get("/v1/account")).json()
        assert before["tenant"] == "alice" and before["object"] == "account"
        assert before["limits"] == {**quota, "max_adapters": 64, "max_adapter_bytes": 2 << 30}
        assert before["in_use"] == dict.fromkeys(quota, 0) | {
            "max_adapters": 0,
            "max_adapter_bytes": 0,
        }
        assert [k["key_id"] for k in before["keys"]] == [before["key_id"]]
        assert before["scheduling"]["weight"] > 0

        done = await alice.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}
        )
        assert done.status_code == 200, done.text
        charged = done.json()["usage"]["total_tokens"]
        for _ in range(100):  # the settlement runs as the response ends
            after = (await alice.get("/v1/account")).json()["in_use"]
            if after["daily_tokens"] == charged:
                break
            await asyncio.sleep(0.02)
        assert after["requests_per_minute"] == 1
        assert after["tokens_per_minute"] == after["daily_tokens"] == charged
        assert after["max_concurrent_requests"] == 0  # it ended
        async with httpx.AsyncClient(base_url=live.gw.url, headers=live.gw.admin_headers) as admin:
            seen = (await admin.get("/admin/tenants/alice/quotas/in-use")).json()
        assert seen == {"tenant": "alice", **{k: after[k] for k in quota}}

        # Bob: no limit set but the default concurrency (none here), nothing of alice's.
        theirs = await bob.get("/v1/account")
        assert theirs.json()["in_use"]["requests_per_minute"] is None
        assert theirs.json()["limits"]["requests_per_minute"] is None
        assert before["key_id"] not in theirs.text
        assert "sk-" not in theirs.text and "sk-" not in (await alice.get("/v1/account")).text


async def test_self_service_keys_only_where_the_admin_allows_and_only_ones_own(live):
    async with (
        as_tenant(live, "alice") as alice,
        as_tenant(live, "bob") as bob,
        httpx.AsyncClient(base_url=live.gw.url, headers=live.gw.admin_headers) as admin,
    ):
        bob_key_id = (await bob.get("/v1/account")).json()["key_id"]
        refused = await alice.post("/v1/account/keys")
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "permission_denied"
        assert (await alice.delete(f"/v1/account/keys/{bob_key_id}")).status_code == 403

        allowed = await admin.put("/admin/tenants/alice/self-service", json={"keys": True})
        assert allowed.json() == {"tenant": "alice", "keys": True}
        assert (await alice.get("/v1/account")).json()["self_service_keys"] is True
        created = await alice.post("/v1/account/keys")
        assert created.status_code == 201 and created.json()["tenant"] == "alice"
        new_key, new_id = created.json()["key"], created.json()["key_id"]
        listed = (await alice.get("/v1/account")).json()["keys"]
        assert new_id in [k["key_id"] for k in listed] and len(listed) == 2
        headers = {"Authorization": f"Bearer {new_key}"}
        assert (await alice.get("/v1/models", headers=headers)).status_code == 200

        # Another tenant's key id answers as a missing one, and stays valid.
        theirs = await alice.delete(f"/v1/account/keys/{bob_key_id}")
        missing = await alice.delete("/v1/account/keys/key_000000000000000000000000")
        assert theirs.status_code == missing.status_code == 404
        assert (await bob.get("/v1/models")).status_code == 200
        assert (await bob.post("/v1/account/keys")).status_code == 403  # bob is not allowed

        revoked = await alice.delete(f"/v1/account/keys/{new_id}")
        assert revoked.status_code == 200
        assert (await alice.get("/v1/models", headers=headers)).status_code == 401
