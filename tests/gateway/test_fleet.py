"""One gateway, two bases: pools by base, per-base tokenizers read without a restart,
adapters bound to their base at upload, and a base whose pool is gone answered 503 by name
while the other keeps serving. Workers are `ScriptedWorker`s (the real stack's two-base test
is tests/e2e/test_fleet_e2e.py)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis.asyncio as aioredis
from tokenizers import Tokenizer

from gateway.fleet.pools import group_pools
from gateway_support import (
    MODEL_NAME,
    TINY_CONFIG,
    ScriptedWorker,
    create_tenant_key,
    delete_prefix,
    files_upload,
    gateway_settings,
    make_model_dir,
    running_gateway,
    write_adapter,
)
from runtime.bases import base_content_id
from runtime.registry import WorkerInfo, deregister, register

OTHER = "tiny-other"
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
OTHER_CONFIG = {
    **TINY_CONFIG,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "max_position_embeddings": 128,
}


def info(worker_id: str, model: str, base_id: str = "", **fields) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id, address="127.0.0.1:1", model=model, base_id=base_id,
        heartbeat_at=time.time(), **fields,
    )  # fmt: skip


async def register_other_base(redis, redis_prefix: str, worker, model_dir) -> None:
    """Register `worker` (a ScriptedWorker) as the pool of the second base, OTHER."""
    await register(
        redis, redis_prefix,
        WorkerInfo(
            worker_id="w-other", address=worker.address, model=OTHER,
            base_id=base_content_id(model_dir), model_path=str(model_dir),
            heartbeat_at=time.time(),
        ),
        ttl=30,
    )  # fmt: skip


def test_pools_group_by_base_and_keep_one_content_per_name():
    workers = [
        info("a1", "/models/tiny-chat"),  # an older worker of the default base: its path
        info("b1", OTHER, "1" * 64, model_path="/m/o"),
        info("b2", OTHER, "1" * 64),
        info("b3", OTHER, "2" * 64),  # the same name, other content: left out
        info("c1", "legacy"),  # no content id, not the default base: unreadable, no pool
    ]
    pools = group_pools(workers, default_base=MODEL_NAME, default_names=frozenset({MODEL_NAME}))
    assert sorted(pools) == [MODEL_NAME, OTHER]
    assert [w.worker_id for w in pools[MODEL_NAME].workers] == ["a1"]
    assert [w.worker_id for w in pools[OTHER].workers] == ["b1", "b2"]
    assert pools[OTHER].base_id == "1" * 64 and pools[OTHER].model_path == "/m/o"


def test_content_id_covers_config_tokenizer_and_weights(tmp_path):
    a = make_model_dir(tmp_path / "a")
    first = base_content_id(a)
    assert base_content_id(a) == first and len(first) == 64
    (a / "model.safetensors").write_bytes(b"weights")
    with_weights = base_content_id(a)
    assert with_weights != first
    (a / "model.safetensors").write_bytes(b"weightz")
    assert base_content_id(a) != with_weights
    (a / "README.md").write_text("not part of the identity")
    assert base_content_id(a) == base_content_id(a)


@pytest.fixture
async def fleet(redis_url, redis_prefix, model_dir, tmp_path):
    """A gateway whose default base is the session's tiny-chat, a second base under its
    model roots appearing after it started, one ScriptedWorker per base, one tenant key."""
    other_dir = make_model_dir(tmp_path / "models" / OTHER)
    (other_dir / "config.json").write_text(json.dumps(OTHER_CONFIG))
    (other_dir / "chat_template.jinja").write_text(PLAIN_TEMPLATE)
    settings = gateway_settings(
        redis_url=redis_url, prefix=redis_prefix, model_dir=model_dir, store=tmp_path / "store",
        model_roots=[tmp_path / "models"], worker_heartbeat_ttl_s=30.0,
    )  # fmt: skip
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    default_worker = await ScriptedWorker("w-default").start()
    other_worker = await ScriptedWorker("w-other", pieces=("Other",)).start()
    try:
        await default_worker.register(redis, redis_prefix)
        async with running_gateway(settings) as gw:
            # The second base's pool appears after the gateway started.
            await register_other_base(redis, redis_prefix, other_worker, other_dir)
            key = await create_tenant_key(gw, "acme")
            headers = {"Authorization": f"Bearer {key}"}
            async with httpx.AsyncClient(base_url=gw.url, headers=headers, timeout=30) as client:
                yield client, redis, default_worker, other_worker, tmp_path
    finally:
        await default_worker.stop()
        await other_worker.stop()
        await delete_prefix(redis_url, redis_prefix)
        await redis.aclose()


def upload(name: str, adapter, **fields) -> dict:
    body = files_upload(name, adapter)
    body["data"].update(fields)
    return body


async def test_each_base_is_served_by_its_own_pool(fleet, redis_prefix):
    client, _redis, default_worker, other_worker, tmp = fleet
    models = (await client.get("/v1/models")).json()["data"]
    by_id = {m["id"]: m for m in models}
    assert set(by_id) == {MODEL_NAME, OTHER}
    assert by_id[OTHER]["max_model_len"] == 128 and by_id[MODEL_NAME]["max_model_len"] == 256

    messages = [{"role": "user", "content": "Hello"}]
    for model, worker in ((MODEL_NAME, default_worker), (OTHER, other_worker)):
        answer = await client.post(
            "/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 1}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == worker.pieces[0]
    assert len(default_worker.requests) == len(other_worker.requests) == 1
    # Each base's own chat template, read when its pool appeared: the plain one is the text.
    reference = Tokenizer.from_file(str(tmp / "models" / OTHER / "tokenizer.json"))
    assert list(other_worker.requests[0].prompt_token_ids) == reference.encode("Hello").ids
    assert len(default_worker.requests[0].prompt_token_ids) > len(reference.encode("Hello").ids)

    # Adapters bind to a base: the form field, then the config's base_model_name_or_path.
    adapter = write_adapter(tmp / "lora", config=OTHER_CONFIG)
    explicit = await client.post("/v1/adapters", **upload("on-other", adapter, base_model=OTHER))
    assert explicit.status_code == 201, explicit.text
    assert explicit.json()["base_model"] == OTHER
    declared = write_adapter(tmp / "declared", seed=1, config=OTHER_CONFIG)
    config = json.loads((declared / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = f"some-org/{OTHER}"
    (declared / "adapter_config.json").write_text(json.dumps(config))
    bound = await client.post("/v1/adapters", **upload("declared", declared))
    assert bound.status_code == 201 and bound.json()["base_model"] == OTHER, bound.text
    plain = await client.post("/v1/adapters", **upload("on-default", write_adapter(tmp / "d")))
    assert plain.json()["base_model"] == MODEL_NAME

    listed = {m["id"]: m["parent"] for m in (await client.get("/v1/models")).json()["data"]}
    assert listed == {MODEL_NAME: None, OTHER: None, "on-other": OTHER, "declared": OTHER,
                      "on-default": MODEL_NAME}  # fmt: skip

    answer = await client.post(
        "/v1/completions", json={"model": "on-other", "prompt": "Hi", "max_tokens": 1}
    )
    assert answer.status_code == 200 and len(other_worker.requests) == 2
    assert other_worker.requests[-1].adapter_id == explicit.json()["adapter_id"]
    # A mix must stay on the request's base.
    mixed = await client.post(
        "/v1/completions",
        json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1,
              "adapters": [{"name": "on-other", "weight": 1.0}]},
    )  # fmt: skip
    assert mixed.status_code == 400 and mixed.json()["error"]["param"] == "adapters"


async def test_an_upload_for_a_base_not_served_is_refused(fleet):
    client, *_, tmp = fleet
    adapter = write_adapter(tmp / "lora")
    refused = await client.post("/v1/adapters", **upload("x", adapter, base_model="no-such-base"))
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "base_model" and "no-such-base" in error["message"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "meta-llama/Llama-3.1-8B"
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    refused = await client.post("/v1/adapters", **upload("y", adapter))
    assert refused.status_code == 400 and "Llama-3.1-8B" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "base_model_name_or_path"
    # Validated against the named base's shapes: the default base's adapter does not fit it.
    wrong_shape = await client.post(
        "/v1/adapters", **upload("z", write_adapter(tmp / "r"), base_model=OTHER)
    )
    assert wrong_shape.status_code == 400, wrong_shape.text
    fits = write_adapter(tmp / "fits", config=OTHER_CONFIG)
    assert (
        await client.post("/v1/adapters", **upload("z", fits, base_model=OTHER))
    ).status_code == 201
    assert (await client.get("/v1/adapters")).json()["data"][0]["base_model"] == OTHER


async def test_a_gone_pool_is_503_for_its_base_only(fleet, redis_prefix):
    client, redis, _default_worker, _other_worker, tmp = fleet
    adapter = write_adapter(tmp / "lora", config=OTHER_CONFIG)
    assert (
        await client.post("/v1/adapters", **upload("on-other", adapter, base_model=OTHER))
    ).status_code == 201
    body = {"model": OTHER, "prompt": "Hello", "max_tokens": 1}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    await deregister(redis, redis_prefix, "w-other")
    for model in (OTHER, "on-other"):
        for stream in (False, True):
            gone = await client.post(
                "/v1/completions", json={**body, "model": model, "stream": stream}
            )
            assert gone.status_code == 503, gone.text
            assert f"`{OTHER}`" in gone.json()["error"]["message"]
            assert gone.json()["error"]["code"] == "no_worker_available"
    served = await client.post("/v1/completions", json={**body, "model": MODEL_NAME})
    assert served.status_code == 200
    assert {m["id"] for m in (await client.get("/v1/models")).json()["data"]} >= {MODEL_NAME}
    usage = {row["model"]: row for row in (await client.get("/v1/usage")).json()["data"]}
    assert set(usage) <= {MODEL_NAME, OTHER, "on-other"}  # per model, as named
    assert usage[MODEL_NAME]["completion_tokens"] == usage[OTHER]["completion_tokens"] == 1
    assert usage.get("on-other", {}).get("total_tokens", 0) == 0  # refused: nothing served


async def test_a_base_outside_the_model_roots_is_not_read(fleet, redis_prefix, tmp_path_factory):
    client, redis, *_ = fleet
    elsewhere = make_model_dir(tmp_path_factory.mktemp("elsewhere") / "outside")
    await register(
        redis, redis_prefix,
        info("w-out", "outside", base_content_id(elsewhere), model_path=str(elsewhere)),
        ttl=30,
    )  # fmt: skip
    answer = await client.post(
        "/v1/completions", json={"model": "outside", "prompt": "Hello", "max_tokens": 1}
    )
    assert answer.status_code == 503 and "`outside`" in answer.json()["error"]["message"]
    assert "outside" not in {m["id"] for m in (await client.get("/v1/models")).json()["data"]}


async def test_a_pool_stopped_within_the_registry_cache_is_503_not_502(
    redis_url, redis_prefix, model_dir, tmp_path
):
    """The gateway still lists the stopped pool's worker (its registry read is cached): the
    call fails to connect, the registry read again says the pool is gone: 503 naming it."""
    other_dir = make_model_dir(tmp_path / "models" / OTHER)
    settings = gateway_settings(
        redis_url=redis_url, prefix=redis_prefix, model_dir=model_dir, store=tmp_path / "store",
        model_roots=[tmp_path / "models"], worker_cache_s=60.0,
    )  # fmt: skip
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    other_worker = await ScriptedWorker("w-other").start()
    try:
        await register_other_base(redis, redis_prefix, other_worker, other_dir)
        async with running_gateway(settings) as gw:
            key = await create_tenant_key(gw, "acme")
            headers = {"Authorization": f"Bearer {key}"}
            body = {"model": OTHER, "prompt": "Hello", "max_tokens": 1}
            async with httpx.AsyncClient(base_url=gw.url, headers=headers, timeout=30) as client:
                assert (await client.post("/v1/completions", json=body)).status_code == 200
                await other_worker.stop()  # it drained and left the registry
                await deregister(redis, redis_prefix, "w-other")
                gone = await client.post("/v1/completions", json=body)
                assert gone.status_code == 503, gone.text
                assert f"`{OTHER}`" in gone.json()["error"]["message"]
    finally:
        await other_worker.stop()
        await delete_prefix(redis_url, redis_prefix)
        await redis.aclose()
