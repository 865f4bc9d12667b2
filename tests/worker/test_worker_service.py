"""The worker's gRPC service over loopback, against the offline ``LLM`` as the reference.

A real grpc.aio server runs in the test's event loop with the engine loop in its thread;
a real Redis holds the registry. The model is a tiny random checkpoint with a byte-level
tokenizer, in fp32 so that greedy choices agree exactly.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.asyncio import Redis

from factories import add_byte_level_tokenizer, make_checkpoint, make_peft_adapter
from rpc import worker_pb2, worker_pb2_grpc
from runtime import registry
from worker import LLM, LLMEngine, SamplingParams, engine_config
from worker.serving.server import WorkerServer

ENGINE_KWARGS = dict(
    dtype="float32", num_kv_blocks=48, max_num_seqs=8, max_loras=2, max_lora_rank=8
)
PROMPT = "hello world, the quick brown fox"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("base"), vocab_size=512, seed=3)
    return add_byte_level_tokenizer(path)


@pytest.fixture(scope="module")
def adapter_dirs(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "qv": make_peft_adapter(base, root / "qv", rank=4, targets=["q_proj", "v_proj"], seed=1),
        "mlp": make_peft_adapter(base, root / "mlp", rank=8, targets=["down_proj"], seed=2),
    }


@pytest.fixture(scope="module")
def store(base, adapter_dirs, tmp_path_factory):
    """The workers' adapter store, as the gateway fills it: validated adapters by content id."""
    from adapters import FilesystemAdapterStore, load_adapter_dir
    from adapters.base_model import BaseModelSpec

    store = FilesystemAdapterStore(tmp_path_factory.mktemp("store"))
    spec = BaseModelSpec.from_config_dict(json.loads((base / "config.json").read_text()))
    for path in adapter_dirs.values():
        store.put(load_adapter_dir(path, base=spec, max_lora_rank=64, max_bytes=1 << 24))
    return store


@pytest.fixture(scope="module")
def offline(base, adapter_dirs):
    """The reference: the offline API, no threads, no gRPC. Adapters named by content id."""
    llm = LLM(base, **ENGINE_KWARGS)
    llm.ids = {name: llm.load_adapter(name, path) for name, path in adapter_dirs.items()}
    return llm


@pytest.fixture
def prompt_ids(offline) -> list[int]:
    return offline.tokenizer.encode(PROMPT, add_special_tokens=False)


async def start_worker(base, **kwargs) -> WorkerServer:
    server = WorkerServer(
        lambda: LLMEngine(base, engine_config(**ENGINE_KWARGS)), model_name="tiny", **kwargs
    )
    await server.start()
    return server


@pytest.fixture
async def worker(base, store):
    server = await start_worker(base, adapter_store=store.root)
    yield server
    await server.shutdown(drain_timeout=2.0)


@pytest.fixture
async def stub(worker):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        yield worker_pb2_grpc.WorkerStub(channel)


def request(prompt_ids, **params) -> worker_pb2.GenerateRequest:
    """A GenerateRequest as the gateway sends it (proto3 bools default to false)."""
    params.setdefault("skip_special_tokens", True)
    adapter_id = params.pop("adapter_id", "")
    tenant = params.pop("tenant", "")
    return worker_pb2.GenerateRequest(
        request_id=params.pop("request_id", "r1"),
        prompt_token_ids=prompt_ids,
        params=worker_pb2.SamplingParams(**params),
        adapter_id=adapter_id,
        tenant=tenant,
    )


async def rest_of(call) -> list[worker_pb2.GenerateResponse]:
    """The remaining messages of a call already read with ``read()``."""
    messages = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        messages.append(msg)
    return messages


async def collect(stub, req) -> list[worker_pb2.GenerateResponse]:
    return [msg async for msg in stub.Generate(req)]


def joined(messages, index: int = 0) -> tuple[list[int], str]:
    mine = [m for m in messages if m.index == index]
    return [t for m in mine for t in m.token_ids], "".join(m.text for m in mine)


async def wait_for(predicate, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.02)


# --- Generate ----------------------------------------------------------------------------


def test_a_requests_speculation_tokens_cross_the_wire_with_zero_apart_from_unset():
    """0 turns speculation off for the request; unset leaves the worker's k: the proto's
    optional field must keep the two apart."""
    from worker.serving.servicer import sampling_params_from_proto

    def read(**fields) -> int | None:
        msg = worker_pb2.SamplingParams(max_tokens=4, **fields)
        return sampling_params_from_proto(msg).num_speculative_tokens

    assert read() is None
    assert read(num_speculative_tokens=0) == 0
    assert read(num_speculative_tokens=3) == 3


async def test_stream_matches_offline_generation(stub, offline, prompt_ids):
    [expected] = offline.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=24))

    messages = await collect(stub, request(prompt_ids, max_tokens=24))

    assert len(messages) > 1  # deltas, not one final message
    assert joined(messages) == (expected.token_ids, expected.text)
    last = messages[-1]
    assert last.finish_reason == expected.finish_reason
    assert all(m.finish_reason == "" for m in messages[:-1])
    assert last.prompt_tokens == len(prompt_ids)
    assert last.completion_tokens == len(expected.token_ids)
    assert [m.completion_tokens for m in messages] == sorted(m.completion_tokens for m in messages)


def merged(messages: list[worker_pb2.GenerateResponse]) -> list[worker_pb2.GenerateResponse]:
    """A stream's deltas as one response a sample (in the order each sample ended): its
    tokens, text and logprobs joined, its last message's ending and counts."""
    whole: dict[int, worker_pb2.GenerateResponse] = {}
    ended: list[int] = []
    for message in messages:
        sample = whole.setdefault(message.index, worker_pb2.GenerateResponse())
        sample.token_ids.extend(message.token_ids)
        sample.text += message.text
        sample.logprobs.extend(message.logprobs)
        sample.prompt_logprobs.extend(message.prompt_logprobs)
        for field in ("index", "finish_reason", "prompt_tokens", "completion_tokens"):
            setattr(sample, field, getattr(message, field))
        sample.cached_tokens = message.cached_tokens
        if message.WhichOneof("stop_reason"):
            setattr(sample, message.WhichOneof("stop_reason"), getattr(
                message, message.WhichOneof("stop_reason")
            ))  # fmt: skip
        if message.finish_reason:
            ended.append(message.index)
    return [whole[i] for i in ended]


@pytest.mark.parametrize(
    "params",
    [
        dict(max_tokens=24, n=2, seed=3, temperature=0.8, logprobs=2),
        dict(max_tokens=32, temperature=0.0, logprobs=1, prompt_logprobs=1),
    ],
    ids=["sampled-n2-logprobs", "stop-string-prompt-logprobs"],
)
async def test_generate_all_answers_what_the_stream_sends_in_one_message_a_sample(
    stub, offline, prompt_ids, params
):
    if "prompt_logprobs" in params:  # greedy, ended by a string from its free answer
        [free] = offline.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=32))
        params = params | {"stop": [free.text[9:11]]}
    req = request(prompt_ids, **params)
    streamed = await collect(stub, req)
    assert len(streamed) > params.get("n", 1)  # deltas: more than one message a sample
    reply = await stub.GenerateAll(req)
    assert list(reply.responses) == merged(streamed)
    assert all(r.finish_reason for r in reply.responses)
    if "stop" in params:
        assert reply.responses[0].stop_string == params["stop"][0]
        assert len(reply.responses[0].prompt_logprobs) == len(prompt_ids) - 1
    assert 0.0 <= reply.first_token_to_end_s < 30.0
    with pytest.raises(grpc.aio.AioRpcError) as info:  # errors keep their codes
        await stub.GenerateAll(request([5, 6], max_tokens=4, top_p=1.5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_cancelling_generate_all_frees_every_kv_block(stub, worker, prompt_ids):
    def cancelled() -> float:
        sample = ("switchboard_worker_requests_total", {"outcome": "cancelled"})
        return worker.metrics.registry.get_sample_value(*sample) or 0.0

    before = cancelled()
    call = stub.GenerateAll(request(prompt_ids, max_tokens=400, ignore_eos=True))
    assert await wait_for(_running(worker))
    call.cancel()

    async def all_free():
        bm = worker.engine.engine.block_manager
        return worker.engine.num_requests == 0 and bm.num_free_blocks == bm.num_blocks

    assert await wait_for(all_free)
    assert cancelled() == before + 1  # aborted, not run to its 400 tokens


def _running(worker):
    async def running() -> bool:
        return worker.engine.num_requests > 0

    return running


async def test_n_samples_are_indexed_and_seeded_per_sample(stub, offline, prompt_ids):
    params = dict(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    expected = [
        offline.generate(prompt_ids, SamplingParams(**(params | {"seed": 7 + i})))[0]
        for i in range(2)
    ]

    messages = await collect(stub, request(prompt_ids, n=2, **params))

    assert {m.index for m in messages} == {0, 1}
    for i in range(2):
        assert joined(messages, i) == (expected[i].token_ids, expected[i].text)
        assert [m.finish_reason for m in messages if m.index == i][-1] == "length"
    assert expected[0].token_ids != expected[1].token_ids


async def test_cached_prompt_tokens_are_reported_and_isolated_per_tenant(stub, prompt_ids):
    prompt = prompt_ids * 4
    cached = []
    for tenant in ("acme", "acme", "globex"):
        messages = await collect(stub, request(prompt, max_tokens=4, tenant=tenant))
        cached.append(messages[-1].cached_tokens)
    # Every full block but the one holding the last prompt token, whose logits are needed.
    assert cached == [0, (len(prompt) - 1) // 16 * 16, 0]
    assert cached[1] > 0


async def test_stats_report_each_tenants_service(stub, prompt_ids):
    """The fair-scheduling ledger the metrics port exports, also in `Stats` (for the admin)."""
    await collect(stub, request(prompt_ids, max_tokens=4, tenant="stats-only"))
    stats = await stub.Stats(worker_pb2.StatsRequest())
    [mine] = [t for t in stats.tenants if t.tenant == "stats-only"]
    assert mine.prefill_tokens == len(prompt_ids) and 1 <= mine.decode_tokens <= 4
    assert mine.weight > 0 and mine.virtual_counter > 0
    assert mine.queued_requests == 1 and mine.queue_time_sum_s >= 0


async def test_stop_string(stub, offline, prompt_ids):
    [free] = offline.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=32))
    stop = free.text[5:7]
    assert stop.strip()
    [expected] = offline.generate(
        prompt_ids, SamplingParams(temperature=0.0, max_tokens=32, stop=[stop])
    )

    messages = await collect(stub, request(prompt_ids, max_tokens=32, stop=[stop]))

    assert joined(messages)[1] == expected.text == free.text[: free.text.index(stop)]
    assert messages[-1].finish_reason == "stop"
    assert messages[-1].WhichOneof("stop_reason") == "stop_string"
    assert messages[-1].stop_string == stop


async def test_stop_token_id(stub, offline, prompt_ids):
    [free] = offline.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=16))
    stop_id = free.token_ids[3]

    messages = await collect(stub, request(prompt_ids, max_tokens=16, stop_token_ids=[stop_id]))

    tokens, _ = joined(messages)
    assert tokens == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert messages[-1].WhichOneof("stop_reason") == "stop_token_id"
    assert messages[-1].stop_token_id == stop_id


async def test_logprobs(stub, offline, prompt_ids):
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    [expected] = offline.generate(prompt_ids, params)

    messages = await collect(stub, request(prompt_ids, max_tokens=8, logprobs=3))

    logprobs = [lp for m in messages for lp in m.logprobs]
    assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
    assert [lp.token_id for lp in logprobs] == expected.token_ids
    for got, want in zip(logprobs, expected.logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t.token_id for t in got.top] == [t for t, _ in want.top_logprobs]
        assert got.top[0].logprob >= got.top[-1].logprob
    # Without the option, none are sent.
    plain = await collect(stub, request(prompt_ids, max_tokens=4, request_id="plain"))
    assert all(len(m.logprobs) == 0 for m in plain)


@pytest.mark.parametrize(
    ("prompt", "params", "code", "message"),
    [
        ([], {}, grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        ([5, 10_000], {}, grpc.StatusCode.INVALID_ARGUMENT, "unknown token ids [10000]"),
        ([5, 6], {"max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        ([5, 6], {"top_p": 1.5}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        ([5, 6], {"n": 1000}, grpc.StatusCode.INVALID_ARGUMENT, "n must be"),
        ([5, 6], {"max_tokens": 5000}, grpc.StatusCode.INVALID_ARGUMENT, "KV blocks"),
        ([5, 6], {"adapter_id": "f" * 64}, grpc.StatusCode.NOT_FOUND, "not in the store"),
        ([5, 6], {"adapter_id": "../x"}, grpc.StatusCode.INVALID_ARGUMENT, "64 lowercase hex"),
    ],
)
async def test_invalid_requests(stub, worker, prompt, params, code, message):
    params = {"max_tokens": 4} | params
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request(prompt, **params))
    assert info.value.code() == code
    assert message in info.value.details()
    assert worker.engine.num_requests == 0


async def test_cancelling_a_stream_frees_every_kv_block(stub, prompt_ids):
    call = stub.Generate(request(prompt_ids, max_tokens=400, ignore_eos=True))
    received = 0
    async for _ in call:
        received += 1
        if received == 3:
            break
    busy = await stub.Stats(worker_pb2.StatsRequest())
    assert busy.running == 1 and busy.free_kv_blocks < busy.total_kv_blocks

    call.cancel()

    async def all_free():
        stats = await stub.Stats(worker_pb2.StatsRequest())
        return stats.running == 0 and stats.free_kv_blocks == stats.total_kv_blocks

    assert await wait_for(all_free, timeout=3.0)


async def test_concurrent_streams_with_mixed_adapters(stub, offline, prompt_ids):
    qv = offline.ids["qv"]
    await stub.LoadAdapter(worker_pb2.LoadAdapterRequest(adapter_id=qv))
    prompts = [prompt_ids, prompt_ids[:4], prompt_ids[2:], prompt_ids]
    names = [None, "qv", None, "qv"]
    expected = offline.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), adapters=names
    )

    requests = [
        request(p, max_tokens=20, ignore_eos=True, request_id=f"c{i}", adapter_id=a or "")
        for i, (p, a) in enumerate(zip(prompts, [None, qv, None, qv], strict=True))
    ]

    results = await asyncio.gather(*(collect(stub, r) for r in requests))

    for messages, want in zip(results, expected, strict=True):
        assert joined(messages) == (want.token_ids, want.text)


async def test_a_failing_step_ends_its_requests_with_internal_and_the_worker_recovers(
    stub, worker, prompt_ids
):
    engine = worker.engine.engine
    real_step = engine.step

    def broken_step():
        engine.step = real_step  # fail once
        raise RuntimeError("boom")

    engine.step = broken_step
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request(prompt_ids, max_tokens=4))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "boom" in info.value.details()

    messages = await collect(stub, request(prompt_ids, max_tokens=4, request_id="after"))
    assert sum(len(m.token_ids) for m in messages) == 4
    assert worker.engine.stats.free_kv_blocks == worker.engine.stats.total_kv_blocks


async def test_an_idle_worker_does_not_spin(worker):
    before = time.process_time()
    await asyncio.sleep(1.0)
    assert time.process_time() - before < 0.1


# --- adapters ----------------------------------------------------------------------------


async def test_load_adapter_then_generate_matches_offline(stub, offline, prompt_ids):
    adapter_id = offline.ids["qv"]
    [expected] = offline.generate(
        prompt_ids, SamplingParams(temperature=0.0, max_tokens=16), adapters=["qv"]
    )
    [base_only] = offline.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=16))
    assert expected.token_ids != base_only.token_ids  # the adapter matters

    loaded = await stub.LoadAdapter(worker_pb2.LoadAdapterRequest(adapter_id=adapter_id))
    messages = await collect(stub, request(prompt_ids, max_tokens=16, adapter_id=adapter_id))

    assert loaded.adapter_id == adapter_id
    assert joined(messages) == (expected.token_ids, expected.text)
    stats = await stub.Stats(worker_pb2.StatsRequest())
    assert stats.adapters_loaded == 1  # a count: which ids are loaded is no caller's business
    assert adapter_id not in str(stats)


async def test_generate_loads_an_adapter_from_the_store(stub, offline, prompt_ids):
    adapter_id = offline.ids["mlp"]
    [expected] = offline.generate(
        prompt_ids, SamplingParams(temperature=0.0, max_tokens=16), adapters=["mlp"]
    )

    messages = await collect(stub, request(prompt_ids, max_tokens=16, adapter_id=adapter_id))

    assert joined(messages) == (expected.token_ids, expected.text)
    await stub.UnloadAdapter(worker_pb2.UnloadAdapterRequest(adapter_id=adapter_id))
    assert (await stub.Stats(worker_pb2.StatsRequest())).adapters_loaded == 0


async def test_generate_reads_an_adapter_from_the_store_by_content_id(
    stub, store, offline, prompt_ids
):
    """What the gateway sends: a content id only; the worker finds it in its own store, and
    an id that is not there is NOT_FOUND (so the gateway may retry elsewhere)."""
    adapter_id = offline.ids["qv"]
    assert store.exists(adapter_id)  # the store's id is the engine's id
    [expected] = offline.generate(
        prompt_ids, SamplingParams(temperature=0.0, max_tokens=16), adapters=["qv"]
    )
    messages = await collect(stub, request(prompt_ids, max_tokens=16, adapter_id=adapter_id))
    assert joined(messages) == (expected.token_ids, expected.text)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request(prompt_ids, max_tokens=4, adapter_id="0" * 64))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_unloading_lets_running_requests_finish(stub, offline, store, prompt_ids):
    """What deleting an adapter does on a worker (the gateway removes it from the store, then
    unloads it): new requests can no longer use it, the ones already running finish with its
    weights, token for token."""
    adapter_id = offline.ids["qv"]
    kept = store.root.parent / f"kept-{adapter_id}"
    [expected] = offline.generate(
        prompt_ids, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), adapters=["qv"]
    )
    call = stub.Generate(request(prompt_ids, max_tokens=24, ignore_eos=True, adapter_id=adapter_id))
    first = await call.read()
    store.get(adapter_id).rename(kept)  # deleted from the store (kept aside for other tests)
    try:
        await stub.UnloadAdapter(worker_pb2.UnloadAdapterRequest(adapter_id=adapter_id))
        messages = [first, *await rest_of(call)]
        assert joined(messages) == (expected.token_ids, expected.text)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, request(prompt_ids, max_tokens=2, adapter_id=adapter_id))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        kept.rename(store.root / adapter_id)


async def test_concurrent_loads_of_one_adapter_read_it_once(worker, offline, adapter_dirs):
    """The gateway's preload and the first request race to load a new adapter: one read."""
    engine = worker.engine
    manager = engine.engine.lora_manager
    reads = []
    real_read = manager.read

    def counting_read(path):
        reads.append(path)
        return real_read(path)

    manager.read = counting_read
    adapter_id = offline.ids["mlp"]
    await asyncio.gather(*(engine.load_adapter(adapter_id, adapter_dirs["mlp"]) for _ in range(3)))
    assert len(reads) == 1 and adapter_id in engine.stats.adapter_ids


async def test_adapter_errors(stub, store, offline):
    # No field of the wire names a path: a worker reads its own store only.
    assert "path" not in worker_pb2.LoadAdapterRequest.DESCRIPTOR.fields_by_name
    assert "adapter_path" not in worker_pb2.GenerateRequest.DESCRIPTOR.fields_by_name
    wrong_id = "e" * 64  # well formed, but not in the store
    for adapter_id, code in [
        (wrong_id, grpc.StatusCode.NOT_FOUND),
        ("", grpc.StatusCode.INVALID_ARGUMENT),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.LoadAdapter(worker_pb2.LoadAdapterRequest(adapter_id=adapter_id))
        assert info.value.code() == code, adapter_id
    # Files under an id they do not hash to (a store tampered with) are refused by content.
    planted = store.root / wrong_id
    shutil.copytree(store.get(offline.ids["qv"]), planted)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.LoadAdapter(worker_pb2.LoadAdapterRequest(adapter_id=wrong_id))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert offline.ids["qv"] in info.value.details()
    finally:
        shutil.rmtree(planted)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.UnloadAdapter(worker_pb2.UnloadAdapterRequest(adapter_id=wrong_id))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert (await stub.Stats(worker_pb2.StatsRequest())).adapters_loaded == 0


@pytest.mark.parametrize(
    "adapter_id",
    ["../x", "/etc", "..", "../" + "a" * 61, "A" * 64, "a" * 63 + "/", "a" * 64 + "/../b"],
)
async def test_a_caller_cannot_make_the_worker_read_a_path_of_its_choosing(
    stub, worker, prompt_ids, adapter_id
):
    """Ids become path names in the store, so anything but 64 lowercase hex digits is refused
    before the file system is touched, by LoadAdapter and by Generate alike."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.LoadAdapter(worker_pb2.LoadAdapterRequest(adapter_id=adapter_id))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request(prompt_ids, max_tokens=2, adapter_id=adapter_id))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert worker.engine.stats.adapter_ids == ()


# --- health, registry, shutdown ----------------------------------------------------------


async def health_status(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        return reply.status


async def test_health_is_serving(worker):
    serving = health_pb2.HealthCheckResponse.SERVING
    assert await health_status(worker.port) == serving
    assert await health_status(worker.port, "switchboard.v1.Worker") == serving


async def test_registry_heartbeats_and_deregisters_on_shutdown(base, redis_url, redis_prefix):
    redis = Redis.from_url(redis_url)
    server = await start_worker(
        base, redis=redis, redis_prefix=redis_prefix, worker_id="w-test", ttl=1,
        heartbeat_interval=0.2,
    )  # fmt: skip
    try:
        [info] = await registry.live_workers(redis, redis_prefix)
        assert (info.worker_id, info.address, info.model) == ("w-test", server.address, "tiny")
        assert info.total_kv_blocks == info.free_kv_blocks == 48
        await asyncio.sleep(1.3)  # past the TTL: only heartbeats keep it alive
        [later] = await registry.live_workers(redis, redis_prefix)
        assert later.heartbeat_at > info.heartbeat_at

        await server.shutdown(drain_timeout=2.0)

        assert await registry.live_workers(redis, redis_prefix) == []
    finally:
        await server.shutdown(drain_timeout=1.0)
        await redis.aclose()


async def test_a_worker_serves_through_a_redis_outage_and_counts_failed_heartbeats(
    base, prompt_ids
):
    """No Redis at the registry's address: the worker still serves (the gateway keeps
    routing to it until its record expires), and each failed heartbeat is counted."""
    from runtime.embedded_redis import free_port

    redis = Redis.from_url(f"redis://127.0.0.1:{free_port()}", socket_connect_timeout=0.5)
    server = await start_worker(base, redis=redis, worker_id="w-alone", heartbeat_interval=0.2)

    async def three_beats_failed() -> bool:
        name = "switchboard_worker_registry_errors_total"
        return (server.metrics.registry.get_sample_value(name) or 0) >= 3

    try:
        assert await wait_for(three_beats_failed)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            replies = await collect(stub, request(prompt_ids, max_tokens=4))
        assert replies[-1].finish_reason == "length"
    finally:
        await server.shutdown(drain_timeout=1.0)
        await redis.aclose()


async def test_drain_finishes_in_flight_and_refuses_new_calls(worker, stub, prompt_ids):
    call = stub.Generate(request(prompt_ids, max_tokens=600, ignore_eos=True))
    first = await call.read()
    assert len(first.token_ids) == 1

    shutdown = asyncio.create_task(worker.shutdown(drain_timeout=20.0))
    await wait_for(lambda: asyncio.sleep(0, worker.servicer.draining))

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request(prompt_ids, max_tokens=4, request_id="late"))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert await health_status(worker.port) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert not shutdown.done()

    rest = await rest_of(call)
    assert 1 + sum(len(m.token_ids) for m in rest) == 600
    assert rest[-1].finish_reason == "length"
    await asyncio.wait_for(shutdown, 10.0)


async def test_a_stop_without_drain_time_aborts_nothing_on_an_idle_worker(worker, caplog):
    """A deadline of 0 s (a failed group's stop, or the stop after a failed start) passes
    at once where no call is open: no abort, no warning."""
    with caplog.at_level("WARNING", logger="worker.serving.server"):
        await worker.shutdown(drain_timeout=0.0)
    assert not [r for r in caplog.records if "drain deadline" in r.getMessage()]


async def test_drain_deadline_aborts_what_is_left(worker, stub, prompt_ids):
    call = stub.Generate(request(prompt_ids, max_tokens=700, ignore_eos=True))
    await call.read()

    await worker.shutdown(drain_timeout=0.1)

    rest = await rest_of(call)
    assert rest[-1].finish_reason == "abort"
    assert worker.engine.stats.free_kv_blocks == worker.engine.stats.total_kv_blocks


def cli_worker_command(base, redis_url, redis_prefix, *flags: str) -> list[str]:
    return [
        sys.executable, "-c", "from switchboard.cli import main; raise SystemExit(main())",
        "worker", "--model", str(base), "--port", "0", "--dtype", "float32",
        "--redis-url", redis_url, "--redis-prefix", redis_prefix, "--worker-id", "cli",
        "--kv-cache-memory-gb", "0.01", "--max-loras", "1", *flags,
    ]  # fmt: skip


async def test_cli_worker_registers_serves_and_drains_on_sigterm(
    base, redis_url, redis_prefix, prompt_ids
):
    redis = Redis.from_url(redis_url)
    command = cli_worker_command(
        base, redis_url, redis_prefix, "--drain-timeout", "5", "--metrics-port", "0"
    )
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        line = await asyncio.wait_for(process.stdout.readline(), 60.0)
        address = line.decode().split()[-1]
        [info] = await registry.live_workers(redis, redis_prefix)
        assert (info.worker_id, info.address) == ("cli", address)
        async with grpc.aio.insecure_channel(address) as channel:
            messages = await asyncio.wait_for(
                collect(worker_pb2_grpc.WorkerStub(channel), request(prompt_ids, max_tokens=4)),
                30.0,
            )
        assert sum(len(m.token_ids) for m in messages) == 4

        process.send_signal(signal.SIGTERM)

        # Within the drain (5 s) plus the stop margin, or the worker dumps its stacks.
        _, stderr = await asyncio.wait_for(process.communicate(), 60.0)
        assert process.returncode == 0, stderr.decode()[-4000:]
        assert await registry.live_workers(redis, redis_prefix) == []
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await redis.aclose()


@pytest.mark.parametrize(
    ("flag", "message"),
    [("--metrics-port", "cannot serve metrics on 127.0.0.1:"), ("--port", "cannot listen on")],
)
async def test_a_cli_worker_whose_port_is_taken_stops_before_it_serves(
    base, redis_url, redis_prefix, flag, message
):
    """A taken port is a configuration error: one line naming the flag, exit 1, before the
    model loads, and never in the registry (a taken metrics port once left a worker that
    no longer served running)."""
    redis = Redis.from_url(redis_url)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The flag's last value wins (argparse): here, over the helper's "--port 0".
        command = cli_worker_command(base, redis_url, redis_prefix, flag, str(port))
        process = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), 60.0)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    try:
        assert process.returncode == 1
        assert stdout == b""  # never announced itself
        last_line = stderr.decode().strip().splitlines()[-1]
        assert last_line.startswith(f"switchboard: error: {message}")
        assert f"choose another {flag} " in last_line
        assert await registry.live_workers(redis, redis_prefix) == []
    finally:
        await redis.aclose()
