"""End to end: real Redis, real worker processes (tiny model), the real gateway under uvicorn,
and the official openai client — exactly the processes `switchboard up` starts."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis

from archive_factories import adapter_members, tar_bytes
from factories import add_byte_level_tokenizer, make_checkpoint, make_peft_adapter
from runtime.embedded_redis import free_port
from runtime.registry import DEFAULT_TTL_S
from runtime.stack import Stack
from worker import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = make_checkpoint(
        tmp_path_factory.mktemp("e2e-model"), vocab_size=512, max_position_embeddings=512, seed=21
    )
    return add_byte_level_tokenizer(path)


@pytest.fixture(scope="module")
def stack(tiny_model, redis_url, tmp_path_factory):
    prefix = f"sbe2e:{os.getpid()}:"
    with Stack(
        model=tiny_model,
        num_workers=2,
        redis_url=redis_url,
        gateway_port=free_port(),
        dtype="float32",
        key_prefix=prefix,
        home=tmp_path_factory.mktemp("home"),
    ) as running:
        yield running


@pytest.fixture(scope="module")
def api_key(stack):
    return stack.create_tenant_key("acme")


@pytest.fixture(scope="module")
def client(stack, api_key):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=api_key, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(tiny_model, dtype="float32")


def test_chat_and_completions_match_the_engine(client, tiny_model, offline):
    model = tiny_model.name
    prompt = "the quick brown fox"
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    done = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    assert done.choices[0].text == expected.text
    assert done.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert done.usage.completion_tokens == len(expected.token_ids)
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected.text
    messages = [{"role": "user", "content": "hello"}]
    chat_prompt = offline.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    expected_chat = offline.generate(
        [chat_prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )[0]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected_chat.text
    assert chat.usage.prompt_tokens == len(expected_chat.prompt_token_ids)
    assert chat.usage.completion_tokens == 8


def test_streaming_chat_with_usage_n2_and_stop(client, tiny_model, offline):
    model = tiny_model.name
    full = client.completions.create(
        model=model, prompt="hello world", max_tokens=30, temperature=0
    )
    text = full.choices[0].text
    stop = text[10:13]
    cut = client.completions.create(
        model=model, prompt="hello world", max_tokens=30, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            n=2,
            seed=5,
            temperature=1.0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    indexes = {c.choices[0].index for c in chunks if c.choices}
    assert indexes == {0, 1}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_best_of_returns_the_most_likely_of_the_seeded_samples(client, tiny_model, offline):
    """best_of=4 returns, of the four samples the worker draws (seeds s..s+3, prompt
    prefilled once and forked), the one the offline engine finds most likely."""
    prompt, seed = "the cat", 11
    candidates = [
        offline.generate(
            [prompt], SamplingParams(temperature=1.0, max_tokens=8, seed=seed + i, logprobs=0)
        )[0]
        for i in range(4)
    ]
    best = max(candidates, key=lambda c: sum(lp.logprob for lp in c.logprobs))
    out = client.completions.create(
        model=tiny_model.name, prompt=prompt, max_tokens=8, temperature=1.0, seed=seed, best_of=4
    )
    assert [c.text for c in out.choices] == [best.text]
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in candidates)


def test_adapter_requests_go_to_the_worker_that_holds_the_adapter(
    stack, client, tiny_model, tmp_path_factory
):
    adapter_dir = make_peft_adapter(
        tiny_model, tmp_path_factory.mktemp("lora") / "sql", rank=8, targets=["q_proj", "v_proj"]
    )
    stack.admin("POST", "/tenants/acme/adapters", json={"name": "sql", "path": str(adapter_dir)})
    offline = LLM(tiny_model, dtype="float32")
    offline.load_adapter("sql", adapter_dir)
    expected = offline.generate(
        ["select"], SamplingParams(temperature=0, max_tokens=10), adapters=["sql"]
    )[0]
    for _ in range(4):
        out = client.completions.create(model="sql", prompt="select", max_tokens=10, temperature=0)
        assert out.choices[0].text == expected.text
    holders = _workers_holding(stack, offline.engine.lora_manager.resolve("sql"))
    assert len(holders) == 1  # affinity: every request went to the same worker
    assert "sql" in [m.id for m in client.models.list().data]


def test_uploaded_adapter_serves_at_once_and_deletion_unloads_it(
    stack, client, api_key, tiny_model, tmp_path_factory
):
    """A tenant uploads an archive over HTTP; the real worker reads it from the store by
    content id; deleting it answers 404 from then on and unloads it from the workers."""
    adapter_dir = make_peft_adapter(
        tiny_model, tmp_path_factory.mktemp("upload") / "mine", rank=4, targets=["o_proj"], seed=9
    )
    offline = LLM(tiny_model, dtype="float32")
    adapter_id = offline.load_adapter("mine", adapter_dir)
    expected = offline.generate(
        ["hello"], SamplingParams(temperature=0, max_tokens=10), adapters=["mine"]
    )[0]
    archive = tar_bytes(adapter_members(adapter_dir, folder="mine"))
    headers = {"Authorization": f"Bearer {api_key}"}
    created = httpx.post(
        f"{stack.base_url}/v1/adapters",
        headers=headers,
        data={"name": "mine"},
        files={"file": ("mine.tar.gz", archive)},
        timeout=30,
    )
    assert created.status_code == 201, created.text
    assert created.json()["adapter_id"] == adapter_id

    out = client.completions.create(model="mine", prompt="hello", max_tokens=10, temperature=0)
    assert out.choices[0].text == expected.text
    assert _workers_holding(stack, adapter_id) != []

    deleted = httpx.delete(f"{stack.base_url}/v1/adapters/mine", headers=headers, timeout=30)
    assert deleted.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mine", prompt="hello", max_tokens=2)
    assert _workers_holding(stack, adapter_id) == []


def test_dora_adapter_uploads_and_chats_as_the_engine_serves_it(
    stack, client, api_key, tiny_model, tmp_path_factory
):
    """A DoRA adapter (``use_dora``) uploaded over HTTP answers a chat as the offline engine
    (held to peft in tests/worker/test_dora_engine.py) does, and not as its plain LoRA would."""
    adapter_dir = make_peft_adapter(
        tiny_model,
        tmp_path_factory.mktemp("dora") / "styled",
        rank=4,
        targets=["q_proj", "v_proj", "down_proj"],
        use_dora=True,
        seed=12,
    )
    offline = LLM(tiny_model, dtype="float32")
    adapter_id = offline.load_adapter("styled", adapter_dir)
    messages = [{"role": "user", "content": "hello there"}]
    prompt = offline.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = offline.generate([prompt], params, adapters=["styled"])[0]
    assert expected.text != offline.generate([prompt], params)[0].text
    archive = tar_bytes(adapter_members(adapter_dir, folder="styled"))
    created = httpx.post(
        f"{stack.base_url}/v1/adapters",
        headers={"Authorization": f"Bearer {api_key}"},
        data={"name": "styled"},
        files={"file": ("styled.tar.gz", archive)},
        timeout=30,
    )
    assert created.status_code == 201, created.text
    assert created.json()["adapter_id"] == adapter_id
    chat = client.chat.completions.create(
        model="styled",
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == expected.text


def test_saved_lm_head_uploads_chats_and_counts_in_the_storage_quota(
    stack, client, api_key, tiny_model, tmp_path_factory
):
    """An adapter with trained copies of lm_head and embed_tokens (modules_to_save) uploaded
    over HTTP chats as the offline engine (held to peft in test_saved_modules_engine.py) does;
    its record and the tenant's storage in use count the copies' float32 bytes."""
    adapter_dir = make_peft_adapter(
        tiny_model,
        tmp_path_factory.mktemp("saved") / "voiced",
        rank=2,
        targets=["q_proj"],
        modules_to_save=["lm_head", "embed_tokens"],
        seed=13,
    )
    offline = LLM(tiny_model, dtype="float32")
    adapter_id = offline.load_adapter("voiced", adapter_dir)
    messages = [{"role": "user", "content": "hello there"}]
    prompt = offline.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = offline.generate([prompt], params, adapters=["voiced"])[0]
    assert expected.text != offline.generate([prompt], params)[0].text
    headers = {"Authorization": f"Bearer {api_key}"}
    before = httpx.get(f"{stack.base_url}/v1/account", headers=headers, timeout=30).json()
    created = httpx.post(
        f"{stack.base_url}/v1/adapters",
        headers=headers,
        data={"name": "voiced"},
        files={"file": ("voiced.tar.gz", tar_bytes(adapter_members(adapter_dir)))},
        timeout=30,
    )
    assert created.status_code == 201, created.text
    assert created.json()["adapter_id"] == adapter_id
    copies = 2 * 4 * offline.engine.config.vocab_size * offline.engine.config.hidden_size
    assert created.json()["num_bytes"] > copies
    after = httpx.get(f"{stack.base_url}/v1/account", headers=headers, timeout=30).json()
    grown = after["in_use"]["max_adapter_bytes"] - before["in_use"]["max_adapter_bytes"]
    assert grown == created.json()["num_bytes"]
    chat = client.chat.completions.create(
        model="voiced",
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == expected.text


def test_replacing_a_version_mid_stream(stack, client, api_key, tiny_model, tmp_path_factory):
    """A stream on version 1 completes on version 1 while version 2 replaces it under the same
    name (``replace=true``); the next request gets version 2, each as the offline engine
    computes it, and the name's record shows the new content."""
    root = tmp_path_factory.mktemp("versions")
    versions = [
        make_peft_adapter(tiny_model, root / f"v{i}", rank=4, targets=["q_proj", "o_proj"], seed=i)
        for i in (31, 32)
    ]
    offline = LLM(tiny_model, dtype="float32")
    prompt, tokens = "the quick brown fox", 200
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    expected = []
    for i, path in enumerate(versions):
        offline.load_adapter(f"v{i}", path)
        expected.append(offline.generate([prompt], params, adapters=[f"v{i}"])[0].text)
    assert expected[0] != expected[1]
    headers = {"Authorization": f"Bearer {api_key}"}

    def upload(path: Path, replace: bool) -> httpx.Response:
        return httpx.post(
            f"{stack.base_url}/v1/adapters",
            headers=headers,
            data={"name": "policy", "replace": "true" if replace else "false"},
            files={"file": ("policy.tar.gz", tar_bytes(adapter_members(path)))},
            timeout=30,
        )

    assert upload(versions[0], False).status_code == 201
    replaced: list[httpx.Response] = []
    body = {
        "model": "policy",
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    events = _stream_events(
        stack, api_key, body, lambda: replaced.append(upload(versions[1], True))
    )
    assert replaced[0].status_code == 200, replaced[0].text
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]")
    assert text == expected[0]
    after = client.completions.create(
        model="policy",
        prompt=prompt,
        max_tokens=tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert after.choices[0].text == expected[1]
    record = httpx.get(f"{stack.base_url}/v1/adapters/policy", headers=headers, timeout=30).json()
    assert record["adapter_id"] == replaced[0].json()["adapter_id"]
    assert record["updated_at"] >= record["created_at"] and record["version"] == 2


def test_a_mix_of_uploaded_adapters_chats_as_the_engine_mixes_them(
    stack, client, api_key, tiny_model, tmp_path_factory
):
    """Two adapters uploaded over HTTP and chatted with as a weighted mix answer as the offline
    engine's mix (held to peft's add_weighted_adapter in test_mix_engine.py) does, and as
    neither adapter alone; past the bound, another tenant's name and a DoRA part are refused
    in OpenAI's format, naming the caller's adapter."""
    root = tmp_path_factory.mktemp("mixes")
    specs = {
        "mix-sql": {"rank": 4, "targets": ["q_proj", "v_proj", "down_proj"], "seed": 41},
        "mix-poet": {"rank": 8, "targets": ["k_proj", "o_proj", "up_proj"], "seed": 42},
        "mix-dora": {"rank": 2, "targets": ["q_proj"], "seed": 43, "use_dora": True},
    }
    dirs = {
        name: make_peft_adapter(tiny_model, root / name, **spec) for name, spec in specs.items()
    }
    offline = LLM(tiny_model, dtype="float32")
    for name in ("mix-sql", "mix-poet"):
        offline.load_adapter(name, dirs[name])
    messages = [{"role": "user", "content": "hello there"}]
    prompt = offline.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    mix = [("mix-sql", 0.7), ("mix-poet", 0.3)]
    expected = offline.generate([prompt], params, adapters=[mix])[0].text
    alone = offline.generate([prompt] * 2, params, adapters=["mix-sql", "mix-poet"])
    assert expected not in {o.text for o in alone}

    def upload(name: str, key: str) -> None:
        created = httpx.post(
            f"{stack.base_url}/v1/adapters",
            headers={"Authorization": f"Bearer {key}"},
            data={"name": name},
            files={"file": (f"{name}.tar.gz", tar_bytes(adapter_members(dirs[name])))},
            timeout=30,
        )
        assert created.status_code == 201, created.text

    for name in specs:
        upload(name, api_key)

    def chat(adapters: list[dict]):
        return client.chat.completions.create(
            model=tiny_model.name,
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "adapters": adapters},
        )

    weighted = [{"name": n, "weight": w} for n, w in mix]
    assert chat(weighted).choices[0].message.content == expected
    with pytest.raises(openai.BadRequestError) as too_many:
        chat([{"name": "mix-sql", "weight": 0.1}] * 5)
    assert too_many.value.body["param"] == "adapters"
    with pytest.raises(openai.BadRequestError) as dora:
        chat([weighted[0], {"name": "mix-dora", "weight": 0.5}])
    assert "'mix-dora' uses DoRA" in dora.value.body["message"]
    other_key = stack.create_tenant_key("globex-mix")
    upload("mix-poet", other_key)
    theirs = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=other_key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as foreign:
        theirs.chat.completions.create(
            model=tiny_model.name,
            messages=messages,
            extra_body={"adapters": [{"name": "mix-sql", "weight": 1.0}]},
        )
    assert foreign.value.code == "model_not_found"


def test_errors_come_back_in_openai_format(stack, client, tiny_model):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert unknown.value.body["code"] == "model_not_found"
    other_key = stack.create_tenant_key("other-tenant")
    other = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=other_key, max_retries=0)
    with pytest.raises(openai.NotFoundError):  # acme's adapter does not exist for them
        other.completions.create(model="sql", prompt="x", max_tokens=2)
    again = stack.create_tenant_key("acme")  # a second `make run` on a persistent Redis
    assert again.startswith("sk-") and again != other_key
    bad = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=tiny_model.name, prompt="x", max_tokens=10**6)


def test_sigterm_drains_a_worker_mid_stream_behind_the_gateway(stack, api_key, tiny_model):
    """A real SIGTERM while the worker streams through the gateway: the stream finishes whole
    (no error event), the worker leaves the registry at once rather than by TTL, requests
    meanwhile succeed (on the other worker: the drained one refuses new calls, which
    tests/worker/test_worker_service.py checks in-process), and the worker exits cleanly."""
    drained = None

    def drain_its_worker() -> None:  # the first token is out, 479 to go
        nonlocal drained
        drained = _serving_worker(stack)
        stack.workers[drained].send_signal(signal.SIGTERM)
        assert _short_completion(stack, api_key, tiny_model).status_code == 200

    body = {**_long_stream(tiny_model), "stream_options": {"include_usage": True}}
    events = _stream_events(stack, api_key, body, on_first_token=drain_its_worker)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks[-3:]
    assert chunks[-1]["usage"]["completion_tokens"] == 480
    assert stack.workers[drained].wait(timeout=30) == 0
    assert drained not in {w["worker_id"] for w in _registry(stack)}  # left, not expired
    # Bring it back for the tests that follow (they expect two workers).
    stack.start_worker(drained)
    stack.wait_ready(timeout=120)


def test_killing_a_worker_mid_stream_ends_the_stream_with_an_error(stack, api_key, tiny_model):
    killed, killed_at = None, 0.0

    def kill_its_worker() -> None:
        nonlocal killed, killed_at
        killed = _serving_worker(stack)
        os.kill(stack.workers[killed].pid, signal.SIGKILL)
        killed_at = time.monotonic()

    events = _stream_events(stack, api_key, _long_stream(tiny_model), kill_its_worker)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    # A stable code; no worker address and no gRPC status for the tenant (the log has them).
    assert error["code"] == "worker_failed", error
    assert "127.0.0.1" not in error["message"] and "UNAVAILABLE" not in error["message"], error
    # The broken connection ends the stream at once, not the request deadline (600 s) or the
    # client's read timeout (60 s); the bound leaves room for a loaded machine.
    assert time.monotonic() - killed_at < 30.0
    # New requests still succeed on the remaining worker.
    time.sleep(0.5)
    ok = _short_completion(stack, api_key, tiny_model)
    assert ok.status_code == 200, ok.text
    # The dead worker never deregistered; its record leaves the registry by its TTL.
    deadline = time.monotonic() + DEFAULT_TTL_S + 5
    while killed in {w["worker_id"] for w in _registry(stack)}:
        assert time.monotonic() < deadline, "the dead worker's record outlived its TTL"
        time.sleep(0.5)


def _long_stream(model) -> dict:
    """A streamed completion of 480 tokens: long enough to act on its worker mid-way."""
    return {
        "model": model.name,
        "prompt": "the quick brown fox",
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def _stream_events(stack, api_key, body, on_first_token) -> list[str]:
    """The stream's data payloads; ``on_first_token()`` runs once the first one is out."""
    headers = {"Authorization": f"Bearer {api_key}"}
    events = []
    with httpx.stream(
        "POST", f"{stack.base_url}/v1/completions", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1:
                    on_first_token()
    return events


def _short_completion(stack, api_key, model) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/v1/completions",
        json={"model": model.name, "prompt": "the quick brown fox", "max_tokens": 4},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=60,
    )


def _serving_worker(stack) -> str:
    """The worker running a request now, asked directly over gRPC (the registry lags)."""
    from rpc import worker_pb2, worker_pb2_grpc

    for worker_id in stack.worker_ports:
        if stack.workers[worker_id].poll() is not None:
            continue
        with stack.worker_channel(worker_id) as channel:  # mutual TLS, as the gateway
            stats = worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5)
        if stats.running + stats.waiting > 0:
            return worker_id
    raise AssertionError("no worker is running the request")


def _registry(stack) -> list[dict]:
    client = redis.Redis.from_url(str(stack.redis_url), decode_responses=True)
    ids = client.smembers(f"{stack.key_prefix}workers")
    raw = [client.get(f"{stack.key_prefix}worker:{i}") for i in ids]
    return [json.loads(r) for r in raw if r]


def _workers_holding(stack, adapter_id: str) -> list[str]:
    time.sleep(2.5)  # one heartbeat publishes the loaded adapters
    return [w["worker_id"] for w in _registry(stack) if adapter_id in w["adapters"]]


def test_workers_answer_only_the_gateways_certificate(stack):
    """`switchboard up` is secure as started: its workers require the client certificate it
    made (mutual TLS) even on loopback; a caller without it gets no answer."""
    import grpc

    from rpc import worker_pb2, worker_pb2_grpc

    live = {w: p for w, p in stack.worker_ports.items() if stack.workers[w].poll() is None}
    assert live  # (a test above kills one)
    for worker_id, port in live.items():
        plain = grpc.insecure_channel(f"127.0.0.1:{port}")
        with plain, pytest.raises(grpc.RpcError) as info:
            worker_pb2_grpc.WorkerStub(plain).Stats(worker_pb2.StatsRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with stack.worker_channel(worker_id) as channel:
            stats = worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5)
        assert stats.total_kv_blocks > 0
