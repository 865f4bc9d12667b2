"""Tenants upload, list, get, use and delete adapters over /v1/adapters (real gateway, real
Redis, real multipart over HTTP). Hostile uploads are refused with precise OpenAI-style
errors, and leave nothing behind: no blob, no staging directory, no name in Redis."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from archive_factories import (
    Member,
    adapter_members,
    pickle_bytes,
    tar_bytes,
    zeros_member,
    zip_bytes,
)
from gateway.batch import storage as batch_storage
from gateway_support import (
    MODEL_NAME,
    archive_upload,
    assert_error,
    files_upload,
    gateway_settings,
    gateway_with_worker,
    write_adapter,
)

MAX_UPLOAD = 2 << 20


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    return write_adapter(tmp_path_factory.mktemp("adapter") / "sql")


class Env:
    """A gateway with tenants alice and bob, a registered ScriptedWorker, and the store."""

    def __init__(self, gw, worker, redis, prefix, keys):
        self.gw, self.worker, self.redis, self.prefix, self.keys = gw, worker, redis, prefix, keys
        self.store: Path = gw.settings.adapter_store

    def http(self, tenant: str) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.keys[tenant]}"}
        return httpx.AsyncClient(base_url=self.gw.url, headers=headers, timeout=30)

    def store_entries(self) -> list[str]:
        """Everything in the store root: adapter ids, and any leftover staging directory (the
        Batch API's folder, which the gateway makes there at start, aside)."""
        return sorted(p.name for p in self.store.iterdir() if p.name != batch_storage.FOLDER)

    async def names(self, tenant: str) -> list[str]:
        return sorted(await self.redis.hkeys(f"{self.prefix}tenant:{tenant}:adapters"))


@pytest.fixture
async def env(redis_url, redis_prefix, model_dir, tmp_path):
    settings = gateway_settings(
        redis_url=redis_url,
        prefix=redis_prefix,
        model_dir=model_dir,
        store=tmp_path / "store",
        max_upload_bytes=MAX_UPLOAD,
        max_adapter_bytes=1 << 20,
        max_lora_rank=8,
        max_archive_members=8,
    )
    async with gateway_with_worker(settings, tenants=("alice", "bob")) as live:
        yield Env(live.gw, live.worker, live.redis, live.prefix, live.keys)


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.02)


# --- the happy paths ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["tar.gz", "zip", "two-files"])
async def test_upload_then_use_list_get_delete(env, adapter_dir, shape):
    members = adapter_members(adapter_dir, folder="sql")
    upload = {
        "tar.gz": lambda: archive_upload("sql", tar_bytes(members)),
        "zip": lambda: archive_upload("sql", zip_bytes(members), "adapter.zip"),
        "two-files": lambda: files_upload("sql", adapter_dir),
    }[shape]()
    async with env.http("alice") as alice:
        created = await alice.post("/v1/adapters", **upload)
        assert created.status_code == 201, created.text
        record = created.json()
        assert record["id"] == record["name"] == "sql" and record["object"] == "adapter"
        assert record["base_model"] == MODEL_NAME and record["rank"] == 4
        assert record["target_modules"] == ["q_proj", "v_proj"]
        assert env.store_entries() == [record["adapter_id"]]  # no staging left behind
        # Preloaded on the worker its requests will go to, while the response went back.
        await _until(lambda: env.worker.loaded == [record["adapter_id"]])

        # Usable as `model` as soon as the upload returned.
        used = await alice.post("/v1/completions", json={"model": "sql", "prompt": "x"})
        assert used.status_code == 200, used.text
        assert env.worker.requests[-1].adapter_id == record["adapter_id"]

        listed = (await alice.get("/v1/adapters")).json()
        assert listed["object"] == "list" and [a["name"] for a in listed["data"]] == ["sql"]
        assert (await alice.get("/v1/adapters/sql")).json() == record

        deleted = await alice.delete("/v1/adapters/sql")
        assert deleted.json() == {"id": "sql", "object": "adapter", "deleted": True}
        assert env.worker.unloaded == [record["adapter_id"]]
        assert env.store_entries() == [] and await env.names("alice") == []
        gone = await alice.post("/v1/completions", json={"model": "sql", "prompt": "x"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert_error(await alice.get("/v1/adapters/sql"), 404, code="not_found")


async def test_names_may_contain_slashes(env, adapter_dir):
    async with env.http("alice") as alice:
        created = await alice.post("/v1/adapters", **files_upload("team/sql-v2", adapter_dir))
        assert created.status_code == 201, created.text
        assert (await alice.get("/v1/adapters/team/sql-v2")).json()["name"] == "team/sql-v2"
        assert (await alice.delete("/v1/adapters/team/sql-v2")).status_code == 200


# --- hostile and broken uploads ----------------------------------------------------------


def _rewrite(adapter: Path, dest: Path, change) -> Path:
    dest.mkdir()
    (dest / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    save_file(change(tensors), str(dest / "adapter_model.safetensors"))
    return dest


def _with_nan(tensors):
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].copy()
    tensors[name][0, 0] = np.nan
    return tensors


def _wrong_hidden(tensors):
    # Made for a base with hidden size 32 instead of 64.
    return {k: (v[:, :32] if "lora_A" in k else v[:32]).copy() for k, v in tensors.items()}


def _extra_layer(tensors):
    # Made for a deeper base: layer 7 does not exist in the 2-layer model.
    extra = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items() if "layers.1." in k}
    return {**tensors, **extra}


def hostile_cases(adapter: Path, tmp: Path, marker: Path) -> dict[str, tuple[dict, tuple]]:
    good = adapter_members(adapter)
    big_rank = write_adapter(tmp / "rank16", rank=16)
    return {
        "traversal": (
            archive_upload("x", tar_bytes([Member("../../escape.json", b"{}"), *good])),
            (400, None, "../../escape.json", "'..'"),
        ),
        "absolute-path": (
            archive_upload("x", tar_bytes([Member("/etc/adapter_config.json", b"{}"), *good])),
            (400, None, "/etc/adapter_config.json", "absolute"),
        ),
        "symlink": (
            archive_upload(
                "x",
                tar_bytes(
                    [good[0], Member("adapter_model.safetensors", kind="symlink", target="/etc")]
                ),
            ),
            (400, None, "adapter_model.safetensors", "links"),
        ),
        "zip-symlink": (
            archive_upload(
                "x", zip_bytes([good[0], Member("adapter_model.safetensors", kind="symlink")])
            ),
            (400, None, "adapter_model.safetensors", "links"),
        ),
        "zip-bomb": (
            archive_upload(
                "x", zip_bytes([good[0], zeros_member("adapter_model.safetensors", 64 << 20)])
            ),
            (413, None, "adapter_model.safetensors", "uncompressed"),
        ),
        "tar-bomb": (
            archive_upload(
                "x", tar_bytes([good[0], zeros_member("adapter_model.safetensors", 64 << 20)])
            ),
            (413, None, "adapter_model.safetensors", "declares 67108864 bytes"),
        ),
        "pickle-payload": (
            archive_upload(
                "x", tar_bytes([*good, Member("adapter_model.bin", pickle_bytes(marker))])
            ),
            (400, None, "adapter_model.bin", "pickled"),
        ),
        "wrong-shapes": (
            files_upload("x", _rewrite(adapter, tmp / "shapes", _wrong_hidden)),
            (400, None, None, "shape"),
        ),
        "wrong-base-model": (
            files_upload("x", _rewrite(adapter, tmp / "deeper", _extra_layer)),
            (400, None, None, "layer"),
        ),
        "nan-weights": (
            files_upload("x", _rewrite(adapter, tmp / "nan", _with_nan)),
            (400, None, None, "finite"),
        ),
        "rank-too-large": (files_upload("x", big_rank), (413, None, None, "rank")),
        "truncated-archive": (
            archive_upload("x", tar_bytes(good)[:400]),
            (400, None, "file", "truncated or corrupt"),
        ),
        "not-an-archive": (archive_upload("x", b"hello"), (400, None, "file", "not a .tar.gz")),
        "empty-name": (
            archive_upload("  ", tar_bytes(good)),
            (400, None, "name", "non-empty `name`"),
        ),
        "bad-name": (archive_upload("../x", tar_bytes(good)), (400, None, "name", "adapter name")),
        "base-model-name": (
            archive_upload(MODEL_NAME, tar_bytes(good)),
            (400, None, "name", "base model"),
        ),
        "missing-weights": (
            archive_upload("x", tar_bytes(good[:1])),
            (400, None, "adapter_model.safetensors", "no adapter_model"),
        ),
        "unexpected-field": (
            {"data": {"name": "x", "extra": "1"}, "files": {"file": ("a", tar_bytes(good))}},
            (400, None, "extra", "unexpected form field `extra`"),
        ),
        "one-of-two-files": (
            {"data": {"name": "x"}, "files": {"adapter_config": ("c", b"{}")}},
            (400, None, "file", "either one `file`"),
        ),
    }


CASE_NAMES = [
    "traversal",
    "absolute-path",
    "symlink",
    "zip-symlink",
    "zip-bomb",
    "tar-bomb",
    "pickle-payload",
    "wrong-shapes",
    "wrong-base-model",
    "nan-weights",
    "rank-too-large",
    "truncated-archive",
    "not-an-archive",
    "empty-name",
    "bad-name",
    "base-model-name",
    "missing-weights",
    "unexpected-field",
    "one-of-two-files",
]


@pytest.mark.parametrize("case", CASE_NAMES)
async def test_hostile_uploads_are_refused_and_leave_nothing(env, adapter_dir, tmp_path, case):
    marker = tmp_path / "pickle-ran"
    upload, (status, code, param, says) = hostile_cases(adapter_dir, tmp_path, marker)[case]
    async with env.http("alice") as alice:
        refused = await alice.post("/v1/adapters", **upload)
        assert_error(refused, status, code=code, param=param, says=says)
        assert (await alice.get("/v1/adapters")).json()["data"] == []
    assert env.store_entries() == []
    assert await env.names("alice") == []
    assert not marker.exists()


async def test_oversized_uploads_are_refused_declared_or_streamed(env, adapter_dir):
    noise = np.random.default_rng(0).bytes(MAX_UPLOAD)  # incompressible
    payload = tar_bytes([*adapter_members(adapter_dir), Member("pad.txt", noise)])
    async with env.http("alice") as alice:
        declared = await alice.post("/v1/adapters", **archive_upload("x", payload))
        assert_error(declared, 413, code="payload_too_large", says="over")

        boundary = "b0undary"
        body = (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nx\r\n'
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n"
            ).encode()
            + payload
            + f"\r\n--{boundary}--\r\n".encode()
        )

        async def chunks():  # no Content-Length: the server must count as it reads
            stream = io.BytesIO(body)
            while chunk := stream.read(64 << 10):
                yield chunk

        headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
        streamed = await alice.post("/v1/adapters", content=chunks(), headers=headers)
        assert_error(streamed, 413, code="payload_too_large")
    assert env.store_entries() == [] and await env.names("alice") == []


async def test_not_multipart_is_a_clear_400(env):
    async with env.http("alice") as alice:
        refused = await alice.post("/v1/adapters", json={"name": "x"})
    assert_error(refused, 400, param="content-type", says="multipart/form-data")


async def test_name_collisions_are_409_and_keep_the_first(env, adapter_dir, tmp_path):
    other = write_adapter(tmp_path / "other", seed=5)
    async with env.http("alice") as alice:
        first = (await alice.post("/v1/adapters", **files_upload("sql", adapter_dir))).json()
        again = await alice.post("/v1/adapters", **files_upload("sql", other))
        assert_error(again, 409, code="conflict", param="name", says="already exists")
        assert (await alice.get("/v1/adapters/sql")).json()["adapter_id"] == first["adapter_id"]
    assert env.store_entries() == [first["adapter_id"]]


async def test_replace_true_makes_new_content_the_names_next_version(env, adapter_dir, tmp_path):
    """The name moves to the new content in one step: new requests use it, the list shows its
    content id and when it changed, the storage in use counts it alone, and the old blob goes
    (and is unloaded) once no name holds it; a second name on the old content keeps it."""
    other = write_adapter(tmp_path / "other", rank=2, seed=5)
    async with env.http("alice") as alice:
        first = (await alice.post("/v1/adapters", **files_upload("sql", adapter_dir))).json()
        await alice.post("/v1/adapters", **files_upload("keep", adapter_dir))
        upload = files_upload("sql", other)
        bad = await alice.post(
            "/v1/adapters", **{**upload, "data": {"name": "sql", "replace": "1"}}
        )
        assert_error(bad, 400, param="replace", says="must be true or false")
        replaced = await alice.post(
            "/v1/adapters", **{**upload, "data": {"name": "sql", "replace": "true"}}
        )
        assert replaced.status_code == 200, replaced.text
        new = replaced.json()
        assert new["adapter_id"] != first["adapter_id"] and new["rank"] == 2
        assert new["created_at"] == first["created_at"] <= new["updated_at"]
        assert (first["version"], new["version"]) == (1, 2)
        assert (await alice.get("/v1/adapters/sql")).json() == new
        used = await alice.post("/v1/completions", json={"model": "sql", "prompt": "x"})
        assert used.status_code == 200 and env.worker.requests[-1].adapter_id == new["adapter_id"]
        account = (await alice.get("/v1/account")).json()
        assert account["in_use"]["max_adapter_bytes"] == first["num_bytes"] + new["num_bytes"]
        assert sorted(env.store_entries()) == sorted([first["adapter_id"], new["adapter_id"]])
        assert first["adapter_id"] not in env.worker.unloaded  # "keep" still names it

        # The same again, now that "sql" alone named the old content: its blob goes.
        again = await alice.post(
            "/v1/adapters",
            **{**files_upload("keep", other), "data": {"name": "keep", "replace": "true"}},
        )
        assert again.status_code == 200, again.text
        assert again.json()["version"] == 2
        assert env.store_entries() == [new["adapter_id"]]
        assert env.worker.unloaded == [first["adapter_id"]]
        # The same content again is idempotent, replace or not.
        same = await alice.post(
            "/v1/adapters", **{**upload, "data": {"name": "sql", "replace": "true"}}
        )
        assert same.status_code == 200 and same.json() == new
        # And a third content is the third version.
        third = await alice.post(
            "/v1/adapters",
            **{**files_upload("sql", adapter_dir), "data": {"name": "sql", "replace": "true"}},
        )
        assert third.status_code == 200 and third.json()["version"] == 3
        listed = {a["name"]: a for a in (await alice.get("/v1/adapters")).json()["data"]}
        assert (listed["sql"]["version"], listed["keep"]["version"]) == (3, 2)


# --- tenants never see each other --------------------------------------------------------


async def test_cross_tenant_isolation_on_every_endpoint(env, adapter_dir):
    async with env.http("alice") as alice, env.http("bob") as bob:
        mine = (await alice.post("/v1/adapters", **files_upload("sql", adapter_dir))).json()

        assert (await bob.get("/v1/adapters")).json()["data"] == []
        bob_models = [m["id"] for m in (await bob.get("/v1/models")).json()["data"]]
        assert bob_models == [MODEL_NAME]

        # Alice's name and a name nobody uses get the very same answers.
        for name in ("sql", "nope"):
            get = assert_error(await bob.get(f"/v1/adapters/{name}"), 404, code="not_found")
            delete = assert_error(await bob.delete(f"/v1/adapters/{name}"), 404, code="not_found")
            assert get["message"] == delete["message"] == f"The adapter `{name}` does not exist."
            use = await bob.post("/v1/completions", json={"model": name, "prompt": "x"})
            assert_error(use, 404, code="model_not_found", says=f"`{name}`")
            chat = await bob.post(
                "/v1/chat/completions",
                json={"model": name, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert_error(chat, 404, code="model_not_found")

        # Bob's attempts disturbed nothing of Alice's.
        assert (await alice.get("/v1/adapters/sql")).json() == mine
        assert env.worker.unloaded == []

        # Names are per tenant: Bob may use "sql" too, for the same content even.
        theirs = await bob.post("/v1/adapters", **files_upload("sql", adapter_dir))
        assert theirs.status_code == 201
        assert theirs.json()["adapter_id"] == mine["adapter_id"]

        # The shared blob stays while either name points at it; workers unload it after both.
        await alice.delete("/v1/adapters/sql")
        assert env.store_entries() == [mine["adapter_id"]] and env.worker.unloaded == []
        used = await bob.post("/v1/completions", json={"model": "sql", "prompt": "x"})
        assert used.status_code == 200
        await bob.delete("/v1/adapters/sql")
        assert env.store_entries() == [] and env.worker.unloaded == [mine["adapter_id"]]


async def test_uploads_need_a_tenant_key(env, adapter_dir):
    async with httpx.AsyncClient(base_url=env.gw.url) as anonymous:
        refused = await anonymous.post("/v1/adapters", **files_upload("sql", adapter_dir))
    assert_error(refused, 401, code="invalid_api_key")
    assert env.store_entries() == []


def test_case_table_is_complete(adapter_dir, tmp_path):
    assert sorted(hostile_cases(adapter_dir, tmp_path, tmp_path / "m")) == sorted(CASE_NAMES)
