"""The gateway stays live under hostile input: body sizes and pace, header pace, prompt bytes,
request shape and non-finite numbers, and the admin API kept off the public port. Every case
goes through the real app under uvicorn (the gateway's own server settings) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn

from gateway.app import create_app
from gateway.http_server import server_config
from gateway.settings import GatewaySettings
from gateway.tokenizer import ChatTokenizer
from gateway_support import (
    ADMIN_TOKEN,
    MODEL_NAME,
    RunningGateway,
    create_tenant_key,
    delete_prefix,
    gateway_settings,
)

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@contextlib.asynccontextmanager
async def served(settings: GatewaySettings) -> AsyncIterator[tuple[RunningGateway, object]]:
    """The app under uvicorn with `gateway.http_server`'s config, as `switchboard gateway`."""
    app = create_app(settings)
    server = uvicorn.Server(server_config(app, settings, port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield RunningGateway(url=f"http://127.0.0.1:{port}", settings=settings), app
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=10)
        await delete_prefix(settings.redis_url, settings.key_prefix)


@pytest.fixture
def settings_for(redis_url, redis_prefix, model_dir, tmp_path):
    def make(**overrides) -> GatewaySettings:
        return gateway_settings(
            redis_url=redis_url,
            prefix=redis_prefix,
            model_dir=model_dir,
            store=tmp_path / "store",
            **overrides,
        )

    return make


async def raw_exchange(url: str, data: bytes, *, wait_s: float = 30.0) -> tuple[bytes, float]:
    """Send `data` on a fresh connection; what came back until the server closed it, and
    how long that took (`wait_s`: a hang guard, past every server-side timeout here)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    started = time.monotonic()
    try:
        writer.write(data)
        received = b""
        async with asyncio.timeout(wait_s):
            with contextlib.suppress(ConnectionResetError):  # closed with our bytes unread
                await writer.drain()
                while chunk := await reader.read(1 << 16):
                    received += chunk
        return received, time.monotonic() - started
    finally:
        writer.close()


def status_and_body(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def assert_openai_error(status: int, body: dict, expected: int, code: str | None = None) -> None:
    assert status == expected, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code


async def test_declared_oversized_body_is_refused_before_auth_and_unread(settings_for):
    settings = settings_for(max_request_body_bytes=64 << 10, http_body_timeout_s=0.5)
    async with served(settings) as (gw, _):
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n"
        )
        # 1 KB of a declared 100 MB, no Authorization: the answer comes without the rest,
        # and the connection closes once the rest has not come for http_body_timeout_s.
        response, took = await raw_exchange(gw.url, head + b"{" + b" " * 1000)
        status, body = status_and_body(response)
        assert_openai_error(status, body, 413, "payload_too_large")
        assert 0.4 < took < 10.0  # at http_body_timeout_s (0.5), loose for a loaded machine


async def test_chunked_oversized_body_is_cut_off_at_the_limit(settings_for):
    settings = settings_for(max_request_body_bytes=64 << 10, http_body_timeout_s=0.5)
    async with served(settings) as (gw, _):
        chunk = b"x" * (16 << 10)
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8))
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        response, _ = await raw_exchange(gw.url, head + chunks)  # no terminating chunk
        assert_openai_error(*status_and_body(response), 413, "payload_too_large")


async def test_other_routes_have_the_small_limit(settings_for):
    async with (
        served(settings_for(max_small_body_bytes=2048)) as (gw, _),
        httpx.AsyncClient(base_url=gw.url, headers=ADMIN) as admin,
    ):
        big = await admin.post("/admin/tenants", json={"name": "x" * 4096})
        assert_openai_error(big.status_code, big.json(), 413, "payload_too_large")
        small = await admin.post("/admin/tenants", json={"name": "fits"})
        assert small.status_code == 201, small.text


async def test_a_body_that_stalls_gets_408(settings_for):
    async with served(settings_for(http_body_timeout_s=0.3)) as (gw, _):
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        )
        response, took = await raw_exchange(gw.url, head + b'{"model"')
        assert_openai_error(*status_and_body(response), 408, "request_timeout")
        assert 0.25 < took < 10.0  # at http_body_timeout_s (0.3), loose for a loaded machine


async def test_slow_headers_are_closed_while_models_stays_fast(settings_for):
    async with served(settings_for(http_header_timeout_s=1.0)) as (gw, _):
        key = await create_tenant_key(gw, "acme")
        slow = asyncio.create_task(
            raw_exchange(gw.url, b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Slow: ")
        )
        answered_meanwhile = 0
        async with httpx.AsyncClient(
            base_url=gw.url, headers={"Authorization": f"Bearer {key}"}
        ) as client:
            while not slow.done():
                assert (await client.get("/v1/models")).status_code == 200
                answered_meanwhile += not slow.done()
                await asyncio.sleep(0.02)
        response, took = await slow
        assert response == b""  # closed without an answer: the headers never completed
        assert 0.9 < took < 10.0  # at http_header_timeout_s, loose for a loaded machine
        # Served while the stalled connection was open: it blocks no one.
        assert answered_meanwhile >= 5


def pieces_exchange(url: str, data: bytes, *, piece: int) -> bytes:
    """Send `data` in pieces of `piece` bytes, each its own write, until the server answers;
    what came back (blocking: run it on a thread)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for start in range(0, len(data), piece):
            if select.select([sock], [], [], 0.02)[0]:
                break  # answered: more bytes would only reset the connection
            sock.sendall(data[start : start + piece])
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 16):
                received += chunk
    return received


async def test_the_header_limit_holds_however_the_bytes_arrive(settings_for):
    """74 KB of headers (5,000 of them) past the 16 KiB bound: a 400 whether the head comes in
    one write or in 4 KB pieces; a head within the bound is served."""
    big = b"GET /v1/models HTTP/1.1\r\nHost: t\r\n"
    big += b"".join(b"X-Filler-%04d: v\r\n" % i for i in range(5000)) + b"\r\n"
    async with served(settings_for()) as (gw, _):
        assert gw.settings.http_max_header_bytes < len(big)
        whole, _ = await raw_exchange(gw.url, big)
        pieces = await asyncio.to_thread(pieces_exchange, gw.url, big, piece=4096)
        fits, _ = await raw_exchange(
            gw.url,
            b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\nX-A: "
            + b"a" * 8000
            + b"\r\n\r\n",
        )
    assert whole.startswith(b"HTTP/1.1 400"), whole[:200]
    assert pieces.startswith(b"HTTP/1.1 400"), pieces[:200]
    assert not fits.startswith(b"HTTP/1.1 400"), fits[:200]


async def test_a_prompt_too_long_in_bytes_is_refused_without_tokenizing(
    settings_for, model_dir, monkeypatch
):
    tokenizer = ChatTokenizer.from_dir(model_dir)
    assert tokenizer.longest_token_bytes is not None  # the tiny byte-level BPE has a bound
    encoded: list[int] = []  # lengths of the texts the gateway tokenized
    encode = ChatTokenizer.encode

    def counted_encode(self, text: str, **kwargs) -> list[int]:
        encoded.append(len(text))
        return encode(self, text, **kwargs)

    monkeypatch.setattr(ChatTokenizer, "encode", counted_encode)
    async with served(settings_for(max_request_body_bytes=64 << 20)) as (gw, _):
        key = await create_tenant_key(gw, "acme")
        prompt = "hello world " * (50_000_000 // 12)  # 50 MB
        async with httpx.AsyncClient(
            base_url=gw.url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        ) as client:
            r = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt})
    assert_openai_error(r.status_code, r.json(), 400)
    error = r.json()["error"]
    # "at least": the byte bound refused it, and the prompt was never tokenized.
    assert error["param"] == "prompt" and "at least" in error["message"], error
    assert encoded == []


def test_the_byte_bound_never_refuses_a_prompt_that_fits(model_dir):
    tokenizer = ChatTokenizer.from_dir(model_dir)
    for text in ["hello world", " " * 5000, "ab" * 3000, "日本語" * 500, "<|im_start|>" * 300]:
        assert tokenizer.min_tokens(text) <= len(tokenizer.encode(text)), text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"stop": "x" * 257}, "stop"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"n": 8, "max_tokens": 200}, "max_tokens"),
    ],
)
async def test_request_shape_bounds(settings_for, extra, param):
    settings = settings_for(max_model_len=4096, max_generated_tokens=1000)
    async with served(settings) as (gw, _):
        key = await create_tenant_key(gw, "acme")
        async with httpx.AsyncClient(
            base_url=gw.url, headers={"Authorization": f"Bearer {key}"}
        ) as client:
            body = {"model": MODEL_NAME, "prompt": "hi", **extra}
            r = await client.post("/v1/completions", json=body)
            assert_openai_error(r.status_code, r.json(), 400)
            assert r.json()["error"]["param"] == param
            chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}] * 1025}
            r = await client.post("/v1/chat/completions", json=chat)
            assert_openai_error(r.status_code, r.json(), 400)
            assert r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize(
    "field",
    [
        '"temperature": NaN',
        '"top_p": Infinity',
        '"presence_penalty": -Infinity',
        '"repetition_penalty": 0.001',
        '"repetition_penalty": 2.5',
        '"min_p": NaN',
    ],
)
async def test_non_finite_and_out_of_range_sampling_values_are_refused(settings_for, field):
    async with served(settings_for()) as (gw, _):
        key = await create_tenant_key(gw, "acme")
        content = f'{{"model": "{MODEL_NAME}", "prompt": "hi", {field}}}'.encode()
        async with httpx.AsyncClient(base_url=gw.url) as client:
            r = await client.post(
                "/v1/completions",
                content=content,
                headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            )
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field.split('"')[1]


async def test_admin_and_docs_on_their_own_port_only(settings_for):
    settings = settings_for(admin_port=0, admin_host="127.0.0.1", docs=True)
    async with served(settings) as (gw, app):
        admin_url = f"http://127.0.0.1:{app.state.admin_port}"
        async with httpx.AsyncClient(headers=ADMIN) as client:
            for path in ("/admin/tenants", "/docs", "/openapi.json", "/metrics"):
                assert (await client.get(gw.url + path)).status_code == 404, path
            created = await client.post(admin_url + "/admin/tenants", json={"name": "acme"})
            assert created.status_code == 201, created.text
            assert (await client.get(admin_url + "/docs")).status_code == 200
            schema = (await client.get(admin_url + "/openapi.json")).json()
            assert "/admin/tenants" in schema["paths"] and "/v1/completions" in schema["paths"]
            assert (await client.get(gw.url + "/health")).status_code == 200


async def test_docs_are_off_outside_dev_mode_and_admin_can_be_switched_off(settings_for):
    async with (
        served(settings_for(admin_api=False)) as (gw, _),
        httpx.AsyncClient(base_url=gw.url, headers=ADMIN) as client,
    ):
        assert (await client.get("/docs")).status_code == 404
        assert (await client.get("/openapi.json")).status_code == 404
        assert (await client.get("/admin/tenants")).status_code == 404


async def test_an_oversized_upload_is_answered_to_a_client_still_sending(settings_for):
    # httpx writes the whole body before it reads: the server drains what it refused
    # instead of resetting the connection, so the client gets its 413 (before any auth).
    async with (
        served(settings_for(max_upload_bytes=256 << 10)) as (gw, _),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        files = {"file": ("a.tar", b"x" * (4 << 20))}
        r = await client.post("/v1/adapters", data={"name": "x"}, files=files)
        assert_openai_error(r.status_code, r.json(), 413, "payload_too_large")
        assert (await client.get("/health")).status_code == 200  # the connection is reusable


def test_every_value_the_gateway_admits_the_worker_admits_too():
    """The gateway's bounds are the workers' or stricter: its extreme values pass there."""
    from gateway.protocol import MAX_N, MAX_TOP_LOGPROBS, MIN_REPETITION_PENALTY
    from worker.sampling import sampling_params as worker

    extremes = [
        {"temperature": 0.0}, {"temperature": 2.0}, {"top_p": 1e-9}, {"min_p": 1.0},
        {"repetition_penalty": MIN_REPETITION_PENALTY}, {"repetition_penalty": 2.0},
        {"presence_penalty": -2.0}, {"frequency_penalty": 2.0}, {"top_k": -1},
        {"logprobs": MAX_TOP_LOGPROBS}, {"seed": -(2**63)}, {"seed": 2**63 - 1},
        {"stop": ["x" * 1024] * 32}, {"stop_token_ids": list(range(1024))},
        {"max_tokens": 2**31 - 1},
    ]  # fmt: skip
    for values in extremes:
        worker.SamplingParams(**values)
    assert MAX_N <= worker.MAX_N
    fields = GatewaySettings.model_fields
    limits = {
        "max_stop_strings": worker.MAX_STOP_STRINGS,
        "max_stop_string_chars": worker.MAX_STOP_STRING_CHARS,
        "max_stop_token_ids": worker.MAX_STOP_TOKEN_IDS,
    }
    for name, worker_limit in limits.items():
        (le,) = [m.le for m in fields[name].metadata if getattr(m, "le", None) is not None]
        assert le <= worker_limit, name


async def test_a_big_n_times_logprobs_answer_is_assembled_off_the_loop(settings_for):
    from gateway_support import gateway_with_worker

    async with gateway_with_worker(settings_for()) as live:
        live.worker.pieces = tuple(f" t{i}" for i in range(200))
        headers = {"Authorization": f"Bearer {live.keys['acme']}"}
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 200, "n": 4, "logprobs": 3}
        async with httpx.AsyncClient(base_url=live.gw.url, headers=headers) as client:
            # 200 tokens × 4 samples × (1 + 3) entries: past INLINE_COLLECT_ENTRIES.
            r = await client.post("/v1/completions", json=body)
            small = await client.post("/v1/completions", json={**body, "n": 1, "max_tokens": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert all(c["text"] == live.worker.text() for c in choices), choices[0]["text"][:80]
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [200] * 4
    assert [len(c["logprobs"]["top_logprobs"]) for c in choices] == [200] * 4
    assert r.json()["usage"]["completion_tokens"] == 800
    # The same shape as an answer assembled inline.
    assert small.status_code == 200 and set(small.json()) == set(r.json())


def _tokenizer_dir(path, tokenizer) -> ChatTokenizer:
    path.mkdir()
    tokenizer.save(str(path / "tokenizer.json"))
    return ChatTokenizer.from_dir(path)


def test_the_byte_bound_is_off_where_a_tokenizer_can_shrink_text(tmp_path):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    def trained(model, trainer, *, pre=None, normalizer=None) -> Tokenizer:
        tokenizer = Tokenizer(model)
        if pre is not None:
            tokenizer.pre_tokenizer = pre
        if normalizer is not None:
            tokenizer.normalizer = normalizer
        tokenizer.train_from_iterator(["hello world " * 50, "the quick brown fox"], trainer)
        return tokenizer

    bpe = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"])
    # WordPiece maps a whole unknown word to one token: no byte bound holds.
    wordpiece = trained(
        models.WordPiece(unk_token="<unk>"),
        trainers.WordPieceTrainer(vocab_size=300, special_tokens=["<unk>"]),
        pre=pre_tokenizers.Whitespace(),
    )
    assert _tokenizer_dir(tmp_path / "wp", wordpiece).longest_token_bytes is None
    # Whitespace splitting drops spaces; NFKC and Strip shrink text.
    dropping = trained(models.BPE(), bpe, pre=pre_tokenizers.Whitespace())
    assert _tokenizer_dir(tmp_path / "ws", dropping).longest_token_bytes is None
    shrinking = trained(models.BPE(), bpe, normalizer=normalizers.NFKC())
    assert _tokenizer_dir(tmp_path / "nfkc", shrinking).longest_token_bytes is None
    # A reachable unknown token (no byte fallback, no byte-level alphabet) covers anything.
    unknown = trained(models.BPE(unk_token="<unk>"), bpe)
    assert _tokenizer_dir(tmp_path / "unk", unknown).longest_token_bytes is None
    # SentencePiece-style BPE with byte fallback and Metaspace keeps a bound, and it holds.
    fallback = trained(
        models.BPE(unk_token="<unk>", byte_fallback=True),
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<unk>", *(f"<0x{b:02X}>" for b in range(256))],
        ),
        pre=pre_tokenizers.Metaspace(),
    )
    sentencepiece = _tokenizer_dir(tmp_path / "sp", fallback)
    assert sentencepiece.longest_token_bytes is not None
    for text in ["hello world " * 100, "ü" * 300, "zzzz qqqq " * 50]:
        assert sentencepiece.min_tokens(text) <= len(sentencepiece.encode(text)), text


async def test_a_kept_alive_connections_next_headers_have_the_deadline_too(settings_for):
    async with served(settings_for(http_header_timeout_s=0.5)) as (gw, _):
        host, port = gw.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split()[0]))
            await asyncio.sleep(0.7)  # idle past the header deadline: keep-alive's to judge
            started = time.monotonic()
            writer.write(b"GET /health HTTP/1.1\r\nHost: t\r\n")  # and never the blank line
            async with asyncio.timeout(30):  # a hang guard
                assert await reader.read() == b""
            # At http_header_timeout_s (0.5), loose for a loaded machine.
            assert 0.4 < time.monotonic() - started < 10.0
        finally:
            writer.close()
