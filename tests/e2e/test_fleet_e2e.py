"""Two bases of different families behind one gateway, as ``switchboard up --model A --model
B`` runs them: one tenant key, a PEFT adapter on each base, every request on its base's pool with
the offline engine's greedy tokens (`worker.LLM`); an upload for a base not served refused;
usage per model; one pool stopped gives 503 naming its base while the other serves. Once with
the filesystem store and once with the S3 store (moto's S3 server; tests/README.md)."""

from __future__ import annotations

import json
import os
import uuid

import httpx
import pytest
import redis

from factories import add_byte_level_tokenizer, make_checkpoint, make_peft_adapter
from runtime.embedded_redis import free_port
from runtime.stack import Stack
from worker import LLM, SamplingParams
from worker.model.tiny_families import make_servable_checkpoint

pytestmark = pytest.mark.slow
PROMPT = "the quick brown fox"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """A tiny Llama and a tiny Qwen3, each with a PEFT adapter, and the offline engine's
    greedy text for each base and adapter."""
    root = tmp_path_factory.mktemp("fleet")
    made = {}
    for family in ("llama", "qwen3"):
        if family == "llama":
            model = add_byte_level_tokenizer(make_checkpoint(root / family, vocab_size=512))
        else:
            model = make_servable_checkpoint(root / family, family, seed=3)
        adapter = make_peft_adapter(
            model, root / f"{family}-lora", rank=4, targets=["q_proj", "v_proj"], seed=5
        )
        llm = LLM(model, dtype="float32")
        llm.load_adapter("lora", adapter)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        base_out = llm.generate([PROMPT], params)[0].text
        lora_out = llm.generate([PROMPT], params, adapters=["lora"])[0].text
        assert base_out != lora_out  # the adapter matters
        made[family] = (model, adapter, base_out, lora_out)
    return made


def upload(client: httpx.Client, name: str, adapter, **fields) -> httpx.Response:
    files = {
        "adapter_config": ("adapter_config.json", (adapter / "adapter_config.json").read_bytes()),
        "adapter_model": (
            "adapter_model.safetensors",
            (adapter / "adapter_model.safetensors").read_bytes(),
        ),
    }
    return client.post("/v1/adapters", data={"name": name, **fields}, files=files)


def complete(client: httpx.Client, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return client.post("/v1/completions", json=body)


@pytest.mark.parametrize("backend", ["filesystem", "s3"])
def test_two_bases_one_api(backend, bases, redis_url, tmp_path, request):
    llama, qwen = bases["llama"], bases["qwen3"]
    store = {}
    if backend == "s3":
        s3 = request.getfixturevalue("s3_server")
        prefix = f"e2e-{uuid.uuid4().hex[:8]}"
        store = {
            "adapter_store_url": f"s3://{s3.bucket}/{prefix}",
            "adapter_store_endpoint": s3.endpoint,
            "env": dict(s3.env),
        }
    key_prefix = f"sbfleet:{os.getpid()}:{backend}:"
    with Stack(
        model=llama[0], extra_models=[qwen[0]], num_workers=1, redis_url=redis_url,
        gateway_port=free_port(), dtype="float32", key_prefix=key_prefix,
        home=tmp_path / "home", **store,
    ) as stack:  # fmt: skip
        key = stack.create_tenant_key("demo")
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=stack.base_url, headers=headers, timeout=120) as client:
            # Bound by base_model_name_or_path (PEFT wrote each base's path).
            for family, (_, adapter, *_) in bases.items():
                made = upload(client, f"{family}-lora", adapter)
                assert made.status_code == 201, made.text
                assert made.json()["base_model"] == family
            refused = upload(client, "nowhere", llama[1], base_model="gemma2")
            assert refused.status_code == 400 and "gemma2" in refused.json()["error"]["message"]

            listed = {m["id"]: m["parent"] for m in client.get("/v1/models").json()["data"]}
            assert listed == {"llama": None, "qwen3": None, "llama-lora": "llama",
                              "qwen3-lora": "qwen3"}  # fmt: skip

            for family, (_, _, base_text, lora_text) in bases.items():
                for model, expected in ((family, base_text), (f"{family}-lora", lora_text)):
                    answer = complete(client, model)
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["choices"][0]["text"] == expected, model
            # Each adapter was loaded only by its own base's pool.
            registry = redis.Redis.from_url(redis_url, decode_responses=True)
            records = {
                w: json.loads(registry.get(f"{key_prefix}worker:{w}") or "{}")
                for w in stack.workers
            }
            ids = {a["name"]: a["adapter_id"] for a in client.get("/v1/adapters").json()["data"]}
            for worker_id, record in records.items():
                family = "qwen3" if worker_id.startswith("qwen3") else "llama"
                assert record["model"] == family
                assert record["adapters"] == [ids[f"{family}-lora"]], worker_id
            usage = client.get("/v1/usage").json()["data"]
            assert {row["model"] for row in usage} == set(listed)

            if backend == "s3":  # the blobs are in the bucket, not in a local store
                keys = [
                    o["Key"]
                    for o in s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=prefix)[
                        "Contents"
                    ]
                ]
                assert {f"{prefix}/blobs/{i}/MANIFEST" for i in ids.values()} <= set(keys)

            stack.stop_pool(qwen[0])
            for model in ("qwen3", "qwen3-lora"):
                gone = complete(client, model)
                assert gone.status_code == 503 and "`qwen3`" in gone.json()["error"]["message"]
            served = complete(client, "llama-lora")
            assert served.status_code == 200
            assert served.json()["choices"][0]["text"] == llama[3]
            registry.close()
