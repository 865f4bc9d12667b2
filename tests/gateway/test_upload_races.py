"""Adapter uploads under contention and hostility, through the real app (uvicorn), real Redis
and real validation children: concurrent uploads of one name, idempotent re-uploads, storage
quotas, the per-tenant upload cap, validation past its limits, and the store's sweep."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest

from archive_factories import adapter_members, tar_bytes, zeros_member, zip64_declaring
from archive_factories import zip_bytes as make_zip
from gateway.batch import storage as batch_storage
from gateway.tenancy.quotas import tenant_key
from gateway_support import (
    archive_upload,
    assert_error,
    files_upload,
    gateway_settings,
    gateway_with_worker,
    running_gateway,
    write_adapter,
)

PATHOLOGICAL = r"([a-z_.0-9]+)+X"  # Python's re: 2^len(name) steps; RE2: linear


def settings_for(redis_url, redis_prefix, model_dir, store: Path, **overrides):
    values = {
        "max_upload_bytes": 2 << 20,
        "max_adapter_bytes": 1 << 20,
        "max_lora_rank": 8,
        "max_archive_members": 8,
        **overrides,
    }
    return gateway_settings(
        redis_url=redis_url, prefix=redis_prefix, model_dir=model_dir, store=store, **values
    )


@pytest.fixture
def store(tmp_path) -> Path:
    return tmp_path / "store"


@pytest.fixture
async def live(redis_url, redis_prefix, model_dir, store):
    """Room for the races' uploads at once (the per-tenant cap has its own gateway)."""
    settings = settings_for(redis_url, redis_prefix, model_dir, store, max_concurrent_uploads=8)
    async with gateway_with_worker(settings, tenants=("alice", "bob")) as live:
        yield live


@pytest.fixture
async def capped(redis_url, redis_prefix, model_dir, store):
    """The default cap: two uploads per tenant at once."""
    settings = settings_for(redis_url, redis_prefix, model_dir, store)
    assert settings.max_concurrent_uploads == 2
    async with gateway_with_worker(settings, tenants=("alice", "bob")) as live:
        yield live


def client(live, tenant: str) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {live.keys[tenant]}"}
    return httpx.AsyncClient(base_url=live.gw.url, headers=headers, timeout=60)


def entries(store: Path) -> list[str]:
    """The store root's entries, the Batch API's folder (made there at start) aside."""
    return sorted(p.name for p in store.iterdir() if p.name != batch_storage.FOLDER)


async def set_quota(live, tenant: str, **quota) -> None:
    async with httpx.AsyncClient(base_url=live.gw.url, headers=live.gw.admin_headers) as admin:
        reply = await admin.put(f"/admin/tenants/{tenant}/quotas", json=quota)
        assert reply.status_code == 200, reply.text


# --- races and idempotence -----------------------------------------------------------


async def test_concurrent_uploads_of_one_name_and_content_agree(live, store, tmp_path):
    adapter = write_adapter(tmp_path / "a")
    async with client(live, "alice") as alice:
        replies = await asyncio.gather(
            *(alice.post("/v1/adapters", **files_upload("sql", adapter)) for _ in range(4))
        )
        assert sorted(r.status_code for r in replies) == [200, 200, 200, 201], replies
        records = [r.json() for r in replies]
        assert all(r == records[0] for r in records)  # one record, whoever answered
        again = await alice.post("/v1/adapters", **files_upload("sql", adapter))
        assert again.status_code == 200 and again.json() == records[0]
        assert (await alice.delete("/v1/adapters/sql")).status_code == 200
    assert entries(store) == []  # one reference in all: one delete frees the blob


async def test_concurrent_uploads_of_one_name_one_wins_the_blob_stays(live, store, tmp_path):
    adapters = [write_adapter(tmp_path / f"a{i}", seed=i) for i in range(4)]
    async with client(live, "alice") as alice:
        replies = await asyncio.gather(
            *(alice.post("/v1/adapters", **files_upload("sql", a)) for a in adapters)
        )
        statuses = sorted(r.status_code for r in replies)
        assert statuses == [201, 409, 409, 409], [r.text for r in replies]
        winner = next(r.json() for r in replies if r.status_code == 201)
        for lost in (r for r in replies if r.status_code == 409):
            assert_error(lost, 409, code="conflict", param="name", says="already exists")
        assert (await alice.get("/v1/adapters/sql")).json() == winner
        # The winner's blob is there and only it: losers left nothing behind.
        assert entries(store) == [winner["adapter_id"]]
        refs = await live.redis.smembers(f"{live.prefix}adapter:{winner['adapter_id']}:refs")
        assert refs == {"alice/sql"}
        used = await alice.post("/v1/completions", json={"model": "sql", "prompt": "x"})
        assert used.status_code == 200


async def test_concurrent_replacements_each_get_their_own_version(live, store, tmp_path):
    """Replacing uploads racing on one name: every one lands, each as a distinct next version
    (a script that saw the name move looks again), and only the last content's blob stays."""
    first, *others = [write_adapter(tmp_path / f"a{i}", seed=i) for i in range(4)]
    async with client(live, "alice") as alice:
        assert (await alice.post("/v1/adapters", **files_upload("sql", first))).status_code == 201
        replies = await asyncio.gather(
            *(
                alice.post(
                    "/v1/adapters",
                    **{**files_upload("sql", a), "data": {"name": "sql", "replace": "true"}},
                )
                for a in others
            )
        )
        assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
        assert sorted(r.json()["version"] for r in replies) == [2, 3, 4]
        last = max((r.json() for r in replies), key=lambda r: r["version"])
        assert (await alice.get("/v1/adapters/sql")).json() == last
    assert entries(store) == [last["adapter_id"]]


async def test_a_delete_racing_an_upload_of_the_same_content_keeps_the_blob(live, store, tmp_path):
    """Bob deletes his name for a blob while Alice uploads the same content: whatever the
    order, Alice's name ends with its blob in the store."""
    adapter = write_adapter(tmp_path / "a")
    async with client(live, "alice") as alice, client(live, "bob") as bob:
        for _ in range(3):
            assert (await bob.post("/v1/adapters", **files_upload("x", adapter))).status_code == 201
            upload, delete = await asyncio.gather(
                alice.post("/v1/adapters", **files_upload("y", adapter)),
                bob.delete("/v1/adapters/x"),
            )
            assert upload.status_code == 201 and delete.status_code == 200
            assert entries(store) == [upload.json()["adapter_id"]]
            assert (await alice.delete("/v1/adapters/y")).status_code == 200
            assert entries(store) == []


# --- quotas and the upload cap --------------------------------------------------------


async def test_storage_quotas_refuse_and_deleting_frees_them(live, tmp_path):
    first, second = write_adapter(tmp_path / "a"), write_adapter(tmp_path / "b", seed=1)
    async with client(live, "alice") as alice:
        await set_quota(live, "alice", max_adapters=1)
        assert (await alice.post("/v1/adapters", **files_upload("one", first))).status_code == 201
        refused = await alice.post("/v1/adapters", **files_upload("two", second))
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["code"] == "adapter_quota_exceeded" and error["type"] == "insufficient_quota"
        assert "has 1 adapters, its limit of 1" in error["message"]
        assert (await alice.delete("/v1/adapters/one")).status_code == 200
        assert (await alice.post("/v1/adapters", **files_upload("two", second))).status_code == 201

        # Bytes: each of these adapters is 7,168 float32 bytes; room for one more only.
        await set_quota(live, "alice", max_adapter_bytes=2 * 7168 - 1)
        refused = await alice.post("/v1/adapters", **files_upload("one", first))
        assert refused.status_code == 403
        assert "Limit 14335 bytes, Used 7168, Requested 7168" in refused.json()["error"]["message"]
        assert [a["name"] for a in (await alice.get("/v1/adapters")).json()["data"]] == ["two"]
    async with client(live, "bob") as bob:  # another tenant's quota is its own
        assert (await bob.post("/v1/adapters", **files_upload("one", first))).status_code == 201


def slow_body(upload: dict, release: asyncio.Event):
    """A multipart body that stops halfway until `release` is set."""
    request = httpx.Request("POST", "http://x/v1/adapters", **upload)
    body = request.read()

    async def chunks():
        yield body[: len(body) // 2]
        await release.wait()
        yield body[len(body) // 2 :]

    return {"content": chunks(), "headers": {"content-type": request.headers["content-type"]}}


async def test_concurrent_uploads_per_tenant_are_capped(capped, tmp_path):
    live = capped
    adapters = [write_adapter(tmp_path / f"a{i}", seed=i) for i in range(3)]
    release = asyncio.Event()
    async with client(live, "alice") as alice, client(live, "bob") as bob:
        held = [
            asyncio.create_task(
                alice.post("/v1/adapters", **slow_body(files_upload(f"n{i}", a), release))
            )
            for i, a in enumerate(adapters[:2])
        ]
        key = tenant_key(live.prefix, "alice", "uploads")
        deadline = time.monotonic() + 10
        while await live.redis.zcard(key) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        refused = await alice.post("/v1/adapters", **files_upload("n2", adapters[2]))
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert "Limit 2, Running 2" in refused.json()["error"]["message"]
        assert "retry-after" in refused.headers
        # Bob's slots are his own.
        assert (await bob.post("/v1/adapters", **files_upload("n", adapters[2]))).status_code == 201
        release.set()
        assert [(await t).status_code for t in held] == [201, 201]
        assert await live.redis.zcard(key) == 0
        assert (
            await alice.post("/v1/adapters", **files_upload("n2", adapters[2]))
        ).status_code == 201


async def test_a_crashed_gateways_upload_slots_come_back(capped, tmp_path):
    live = capped
    key = tenant_key(live.prefix, "alice", "uploads")
    # Two slots held by a gateway that died: their leases end in 2 s (long enough for the
    # first upload to arrive before them on a loaded machine).
    lease_end_ms = int(time.time() * 1000) + 2_000
    await live.redis.zadd(key, {"dead-1": lease_end_ms, "dead-2": lease_end_ms})
    adapter = write_adapter(tmp_path / "a")
    async with client(live, "alice") as alice:
        refused = await alice.post("/v1/adapters", **files_upload("x", adapter))
        assert refused.status_code == 429
        await asyncio.sleep(max(0.0, lease_end_ms / 1000 - time.time()) + 0.2)
        assert (await alice.post("/v1/adapters", **files_upload("x", adapter))).status_code == 201


# --- hostile uploads: refused fast, the gateway unaffected -----------------------------


def _edited(adapter: Path, **config) -> dict:
    upload = files_upload("x", adapter)
    changed = {**json.loads((adapter / "adapter_config.json").read_text()), **config}
    upload["files"]["adapter_config"] = ("adapter_config.json", json.dumps(changed).encode())
    return upload


def _giant_header(adapter: Path) -> dict:
    upload = files_upload("x", adapter)
    data = (2**62).to_bytes(8, "little") + b"{}" + bytes(62)
    upload["files"]["adapter_model"] = ("adapter_model.safetensors", data)
    return upload


HOSTILE = {
    "pathological-regex": (
        lambda a: _edited(a, target_modules=PATHOLOGICAL),
        (400, None, "does not target"),
    ),
    "backreference": (
        lambda a: _edited(a, target_modules=r"(q)_proj\1"),
        (400, "target_modules", "RE2"),
    ),
    "huge-rank": (lambda a: _edited(a, r=10**9), (400, "r", "is over 65536")),
    "inf-alpha": (lambda a: _edited(a, lora_alpha=float("inf")), (400, None, "Infinity")),
    "giant-header": (_giant_header, (400, None, "over the limit of 1048576 bytes")),
    "million-entry-zip": (
        lambda a: archive_upload(
            "x", zip64_declaring(make_zip(adapter_members(a)), entries=10**6), "a.zip"
        ),
        (413, "file", "1000000 members"),
    ),
}


# A hang guard. Each refusal comes from a check on the upload's shape (linear-time regexes,
# the 8-byte header prefix, the zip's end record); an upload that ran the validation child
# into its CPU limit instead (60 s by default) would time the client out (60 s) or answer 422.
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_uploads_are_refused_fast(live, store, tmp_path, case):
    build, (status, param, says) = HOSTILE[case]
    async with client(live, "alice") as alice:
        refused = await alice.post("/v1/adapters", **build(write_adapter(tmp_path / "a")))
        assert_error(refused, status, param=param, says=says)
    assert entries(store) == []


async def test_validation_past_its_memory_limit_is_413_and_the_gateway_lives_on(
    redis_url, redis_prefix, model_dir, store, tmp_path
):
    """A 160 MiB weights file packed into ~160 KiB: reading it takes the child past its
    256 MiB address space (Python and numpy are ~150 MiB of it); the gateway answers 413
    and goes on serving, uploads included."""
    settings = settings_for(
        redis_url,
        redis_prefix,
        model_dir,
        store,
        max_adapter_bytes=200 << 20,
        upload_validation_memory_bytes=256 << 20,
    )
    adapter = write_adapter(tmp_path / "a")
    config = adapter_members(adapter)[0]
    bomb = tar_bytes([config, zeros_member("adapter_model.safetensors", 160 << 20)])
    async with (
        gateway_with_worker(settings, tenants=("alice",)) as live,
        client(live, "alice") as alice,
    ):
        refused, health = await asyncio.gather(
            alice.post("/v1/adapters", **archive_upload("x", bomb)),
            alice.get("/health"),
        )
        assert health.status_code == 200
        assert_error(refused, 413, code="payload_too_large", says="bytes of memory")
        ok = await alice.post("/v1/adapters", **files_upload("x", adapter))
        assert ok.status_code == 201
        assert entries(store) == [ok.json()["adapter_id"]]


# --- the store's sweep ---------------------------------------------------------------


async def test_crash_leftovers_are_swept_at_start_named_blobs_never(
    redis_url, redis_prefix, model_dir, store, tmp_path
):
    settings = settings_for(redis_url, redis_prefix, model_dir, store, adapter_sweep_grace_s=60)
    adapter = write_adapter(tmp_path / "a")
    async with gateway_with_worker(settings, tenants=("alice",)) as live:
        async with client(live, "alice") as alice:
            named = (await alice.post("/v1/adapters", **files_upload("x", adapter))).json()
        # What crashes leave: staging and trash directories, a blob nobody named.
        orphan = "f" * 64
        for leftover in (".upload-dead", ".tmp-dead", ".trash-dead", orphan, ".upload-fresh"):
            (store / leftover).mkdir()
            (store / leftover / "adapter_config.json").write_text("{}")
        old = time.time() - 3600
        for path in (".upload-dead", ".tmp-dead", ".trash-dead", orphan, named["adapter_id"]):
            os.utime(store / path, (old, old))
        fresh_orphan = "e" * 64  # unnamed but young: an upload may be about to name it
        (store / fresh_orphan).mkdir()

        async with running_gateway(settings):  # a second replica starting sweeps
            deadline = time.monotonic() + 10
            while (store / orphan).exists():
                assert time.monotonic() < deadline, entries(store)
                await asyncio.sleep(0.05)
        assert entries(store) == sorted([".upload-fresh", fresh_orphan, named["adapter_id"]])
        async with client(live, "alice") as alice:
            used = await alice.post("/v1/completions", json={"model": "x", "prompt": "x"})
            assert used.status_code == 200
