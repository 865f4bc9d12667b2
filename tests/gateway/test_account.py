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

        # Bob: no limit set but the default concurrency (none here), nothing of alice's.
        theirs = await bob.get("/v1/account")
        assert theirs.json()["in_use"]["requests_per_minute"] is None
        assert theirs.json()["limits"]["requests_per_minute"] is None
        assert before["key_id"] not in theirs.text
        assert "sk-" not in theirs.text and "sk-" not in (await alice.get("/v1/account")).text
