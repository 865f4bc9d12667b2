"""The Batch API through the real stack (Redis, a worker on a tiny random model, the gateway
under uvicorn) with the official `openai` client: files.create → batches.create →
batches.retrieve → files.content, each line's answer equal to the same request sent
interactively (greedy), over the base and two adapters, 1,000 lines each once; a line the API
refuses in the error file with the API's own error; a gateway killed mid-batch whose batch
another gateway finishes with each line once and billed once; cancel; expiry."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest
import redis

from factories import add_byte_level_tokenizer, make_checkpoint, make_peft_adapter
from runtime.embedded_redis import free_port
from runtime.processes import reap
from runtime.stack import Stack, switchboard_command

pytestmark = pytest.mark.slow

PROMPTS = ["the quick brown fox", "hello there", "batch work fills idle time", "one two three"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = make_checkpoint(
        tmp_path_factory.mktemp("batch-model"), vocab_size=512, max_position_embeddings=1024,
        eos_token_id=0, seed=29,
    )  # fmt: skip
    return add_byte_level_tokenizer(path)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-adapters")
    return {
        name: make_peft_adapter(tiny_model, root / name, rank=4, targets=targets, seed=seed)
        for name, targets, seed in (
            ("sql", ["q_proj", "v_proj"], 1),
            ("poet", ["up_proj", "o_proj"], 2),
        )
    }


@pytest.fixture(scope="module")
def stack(tiny_model, adapters, redis_url, tmp_path_factory):
    saved = dict(os.environ)
    os.environ.update(
        SWITCHBOARD_BATCH_POLL_S="0.2",
        SWITCHBOARD_BATCH_LEASE_S="1.5",
        SWITCHBOARD_BATCH_LINES_IN_FLIGHT="2",
        SWITCHBOARD_BATCH_COMPLETION_WINDOWS=json.dumps({"24h": 86400, "3s": 3}),
    )
    try:
        with Stack(
            model=tiny_model,
            redis_url=redis_url,
            gateway_port=free_port(),
            dtype="float32",
            key_prefix=f"sbbatch:{os.getpid()}:",
            home=tmp_path_factory.mktemp("batch-home"),
        ) as running:
            for tenant in ("acme", "kill", "other", "many"):
                running.create_tenant_key(tenant)
                for name, path in adapters.items():
                    body = {"name": name, "path": str(path)}
                    running.admin("POST", f"/tenants/{tenant}/adapters", json=body)
            yield running
    finally:
        os.environ.clear()
        os.environ.update(saved)


def client_of(stack: Stack, tenant: str) -> openai.OpenAI:
    key = stack.create_tenant_key(tenant)
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(custom_id: str, model: str, prompt: str, max_tokens: int = 8) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def submit(
    client: openai.OpenAI, lines: list[dict], *, endpoint="/v1/chat/completions", window="24h"
):
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint=endpoint, completion_window=window,
        metadata={"job": "test"},
    )  # fmt: skip


def wait_for(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} is still {batch.status}")


def read_lines(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    text = client.files.content(file_id).text
    return {row["custom_id"]: row for row in map(json.loads, text.splitlines())}


def test_a_batch_over_adapters_answers_as_the_interactive_api(stack, tiny_model):
    client = client_of(stack, "acme")
    base = tiny_model.name
    lines = [
        chat_line(f"line-{i}", model, prompt)
        for i, (model, prompt) in enumerate(
            (m, p) for m in (base, "sql", "poet") for p in PROMPTS[:3]
        )
    ]
    lines.append(chat_line("missing-model", "nope", "hi"))
    lines.append({**chat_line("bad-value", base, "hi"), "body": {"model": base, "messages": []}})
    batch = submit(client, lines)
    assert batch.status == "validating" and batch.endpoint == "/v1/chat/completions"
    assert batch.metadata == {"job": "test"}
    done = wait_for(client, batch.id, {"completed", "failed"})
    assert done.status == "completed", done.errors
    assert done.request_counts.total == len(lines)
    assert (done.request_counts.completed, done.request_counts.failed) == (len(lines) - 2, 2)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    outputs = read_lines(client, done.output_file_id)
    errors = read_lines(client, done.error_file_id)
    assert set(outputs) == {line["custom_id"] for line in lines[:-2]}
    for line in lines[:-2]:
        expected = client.chat.completions.create(**line["body"])
        got = outputs[line["custom_id"]]["response"]
        assert got["status_code"] == 200
        assert got["body"]["choices"][0]["message"]["content"] == (
            expected.choices[0].message.content
        ), line["custom_id"]
        assert got["body"]["usage"]["completion_tokens"] == expected.usage.completion_tokens
    missing = errors["missing-model"]["response"]
    assert missing["status_code"] == 404 and missing["body"]["error"]["code"] == "model_not_found"
    assert errors["bad-value"]["response"]["status_code"] == 400
    files = client.files.list(purpose="batch_output")
    assert {done.output_file_id, done.error_file_id} <= {f.id for f in files.data}
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert done.usage.output_tokens == sum(
        o["response"]["body"]["usage"]["completion_tokens"] for o in outputs.values()
    )
    listed = client.batches.list(limit=5)
    assert listed.data[0].id == batch.id


def test_a_thousand_lines_over_three_models_each_once_as_the_interactive_api(stack, tiny_model):
    """1,000 lines over the base and two adapters: each line answered once, billed once, and
    each (model, prompt) pair's answer the interactive API's."""
    client = client_of(stack, "many")
    before = usage_requests(stack, client)
    models = (tiny_model.name, "sql", "poet")
    lines = [
        chat_line(f"m{i}", models[i % 3], PROMPTS[i // 3 % 4], max_tokens=2) for i in range(1000)
    ]
    done = wait_for(client, submit(client, lines).id, {"completed", "failed"}, timeout=600)
    assert done.status == "completed", done.errors
    assert (done.request_counts.completed, done.request_counts.failed) == (1000, 0)
    rows = [json.loads(r) for r in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(x["custom_id"] for x in lines)
    answers = {
        r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in rows
    }
    expected = {}
    for line in lines:
        body = line["body"]
        pair = (body["model"], body["messages"][0]["content"])
        if pair not in expected:
            expected[pair] = client.chat.completions.create(**body).choices[0].message.content
        assert answers[line["custom_id"]] == expected[pair], line["custom_id"]
    assert len(expected) == 12
    assert usage_requests(stack, client) - before == 1000 + len(expected)


def test_a_broken_file_fails_the_batch_naming_its_lines(stack, tiny_model):
    client = client_of(stack, "acme")
    lines = [chat_line("a", tiny_model.name, "x"), chat_line("a", tiny_model.name, "y")]
    lines.append({**chat_line("b", tiny_model.name, "z"), "url": "/v1/completions"})
    failed = wait_for(client, submit(client, lines).id, {"failed", "completed"})
    assert failed.status == "failed"
    assert [(e.line, e.code) for e in failed.errors.data] == [
        (2, "duplicate_custom_id"),
        (3, "mismatched_url"),
    ]


def test_files_are_the_tenants_own(stack):
    acme, other = client_of(stack, "acme"), client_of(stack, "other")
    uploaded = acme.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    assert uploaded.bytes == 3 and uploaded.filename == "x.jsonl" and uploaded.expires_at
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(uploaded.id)
    with pytest.raises(openai.BadRequestError):
        acme.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert acme.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        acme.files.retrieve(uploaded.id)


def usage_requests(stack: Stack, client: openai.OpenAI) -> int:
    response = httpx.get(
        f"{stack.base_url}/v1/usage", headers={"Authorization": f"Bearer {client.api_key}"}
    )
    return sum(row["requests"] for row in response.json()["data"])


def restart_gateway(stack: Stack) -> None:
    stack.gateway = subprocess.Popen(
        [*switchboard_command(), "gateway", "--port", str(stack.gateway_port)], env=stack._env()
    )
    stack.wait_ready(timeout=120)


def submit_and_wait_for_lines(stack: Stack, client, lines: list[dict], count: int):
    """Submit a batch of tenant "kill"; return it, a Redis client and its lines' hash once
    `count` lines have a recorded result."""
    batch = submit(client, lines)
    store = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    lines_key = f"{stack.key_prefix}{{kill}}:batch:{batch.id}:lines"
    deadline = time.monotonic() + 60
    while store.hlen(lines_key) < count:
        assert time.monotonic() < deadline, "no line finished"
        time.sleep(0.05)
    return batch, store, lines_key


def test_a_gateway_killed_mid_batch_leaves_it_to_the_next_each_line_once(stack, tiny_model):
    client = client_of(stack, "kill")
    before = usage_requests(stack, client)
    lines = [chat_line(f"k{i}", tiny_model.name, PROMPTS[i % 4], max_tokens=48) for i in range(16)]
    batch, store, lines_key = submit_and_wait_for_lines(stack, client, lines, 3)
    stack.gateway.send_signal(signal.SIGKILL)
    reap(stack.gateway, 10)
    recorded = store.hlen(lines_key)
    assert recorded < len(lines), "the batch finished before the kill: make its lines longer"
    restart_gateway(stack)
    done = wait_for(client, batch.id, {"completed", "failed"})
    assert done.status == "completed"
    assert done.request_counts.completed == len(lines)
    rows = client.files.content(done.output_file_id).text.splitlines()
    assert sorted(json.loads(r)["custom_id"] for r in rows) == sorted(x["custom_id"] for x in lines)
    assert usage_requests(stack, client) - before == len(lines)  # each line billed once


def test_cancel_stops_the_batch_and_keeps_what_finished(stack, tiny_model):
    client = client_of(stack, "other")
    lines = [chat_line(f"c{i}", tiny_model.name, PROMPTS[i % 4], max_tokens=64) for i in range(40)]
    batch = submit(client, lines)
    wait_for(client, batch.id, {"in_progress"})
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_for(client, batch.id, {"cancelled"})
    assert done.cancelling_at and done.cancelled_at
    assert done.request_counts.completed < len(lines)
    assert len(read_lines(client, done.output_file_id)) == done.request_counts.completed
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_unfinished_lines_expire_with_an_error_line(stack, tiny_model):
    client = client_of(stack, "other")
    # Far more work than the window holds on any CPU (the tiny model finished 60 such lines
    # within 3 s on a quiet 2-core machine): the window, not the work, must end it.
    lines = [
        chat_line(f"e{i}", tiny_model.name, PROMPTS[i % 4], max_tokens=64) for i in range(1000)
    ]
    batch = submit(client, lines, window="3s")
    done = wait_for(client, batch.id, {"expired", "completed"})
    assert done.status == "expired" and done.expired_at
    errors = read_lines(client, done.error_file_id)
    outputs = read_lines(client, done.output_file_id)
    assert len(errors) + len(outputs) == len(lines)
    assert errors and all(e["error"]["code"] == "batch_expired" for e in errors.values())
    assert done.request_counts.failed == len(errors)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/responses"])
def test_completions_and_responses_batches_answer_as_the_api_does(stack, tiny_model, endpoint):
    client = client_of(stack, "acme")
    if endpoint == "/v1/completions":
        bodies = [
            {"model": m, "prompt": p, "max_tokens": 6, "temperature": 0}
            for m, p in ((tiny_model.name, PROMPTS[0]), ("sql", PROMPTS[1]))
        ]
    else:
        bodies = [
            {"model": m, "input": p, "max_output_tokens": 6, "temperature": 0}
            for m, p in ((tiny_model.name, PROMPTS[0]), ("poet", PROMPTS[1]))
        ]
    lines = [
        {"custom_id": f"x{i}", "method": "POST", "url": endpoint, "body": body}
        for i, body in enumerate(bodies)
    ]
    done = wait_for(client, submit(client, lines, endpoint=endpoint).id, {"completed", "failed"})
    assert done.status == "completed" and done.request_counts.completed == len(lines)
    outputs = read_lines(client, done.output_file_id)
    for line in lines:
        got = outputs[line["custom_id"]]["response"]["body"]
        if endpoint == "/v1/completions":
            expected = client.completions.create(**line["body"])
            assert got["choices"][0]["text"] == expected.choices[0].text
        else:
            expected = client.responses.create(**line["body"])
            assert got["object"] == "response"
            assert got["output"][0]["content"][0]["text"] == expected.output_text


def test_a_worker_killed_mid_batch_costs_its_lines_a_retry_not_a_result(stack, tiny_model):
    """Lines in flight on a worker that dies fail as the worker's failure (never as the
    line's): they run again once a worker is back, and the batch completes with each line
    once and billed once."""
    client = client_of(stack, "kill")
    before = usage_requests(stack, client)
    lines = [chat_line(f"w{i}", tiny_model.name, PROMPTS[i % 4], max_tokens=48) for i in range(12)]
    batch, store, lines_key = submit_and_wait_for_lines(stack, client, lines, 2)
    (worker_id,) = list(stack.workers)
    stack.workers[worker_id].send_signal(signal.SIGKILL)
    reap(stack.workers[worker_id], 10)
    assert store.hlen(lines_key) < len(lines)
    stack.start_worker(worker_id)
    stack.wait_ready(timeout=120)
    done = wait_for(client, batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (len(lines), 0)
    rows = client.files.content(done.output_file_id).text.splitlines()
    assert sorted(json.loads(r)["custom_id"] for r in rows) == sorted(x["custom_id"] for x in lines)
    assert usage_requests(stack, client) - before == len(lines)
