"""The hostile-input suite: one attacker, one victim, the real stack (`switchboard up`'s processes).

Each case sends one attack through real uvicorn, a real worker and real Redis while a victim
tenant streams a greedy completion on the same worker, again and again until the attack is
over. The attack must get a 4xx in OpenAI's error format (never a 5xx, never a hang), and
every victim stream must carry exactly the text of an unattacked run. A prober reads
`/v1/models` throughout; its latencies are checked (loosely: liveness, not speed) at the end
and printed, and `bench/hostile_latency.py` reports their p99.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import select
import socket
import statistics
import struct
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from unittest import mock

import httpx
import pytest

from archive_factories import Member, adapter_members, pickle_bytes, tar_bytes, zip_bytes
from factories import add_byte_level_tokenizer, make_checkpoint, make_peft_adapter
from runtime.embedded_redis import free_port
from runtime.stack import Stack

pytestmark = pytest.mark.slow

VICTIM_TOKENS = 120


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = make_checkpoint(
        tmp_path_factory.mktemp("hostile-model"),
        vocab_size=512,
        max_position_embeddings=512,
        seed=27,
    )
    return add_byte_level_tokenizer(path)


@pytest.fixture(scope="module")
def stack(tiny_model, redis_url, tmp_path_factory):
    # A 3 s header deadline (10 by default) so the slowloris test waits 3 s for its close; a
    # tenant's queue on the grammar checkers of 4 (16 by default) so a flood ends sooner.
    environ = {
        "SWITCHBOARD_HTTP_HEADER_TIMEOUT_S": "3",
        "SWITCHBOARD_GRAMMAR_CHECK_QUEUE_PER_TENANT": "4",
    }
    with (
        mock.patch.dict(os.environ, environ),
        Stack(
            model=tiny_model,
            num_workers=1,  # victim and attacker share one worker and its engine steps
            redis_url=redis_url,
            gateway_port=free_port(),
            dtype="float32",
            key_prefix=f"sbhostile:{os.getpid()}:",
            home=tmp_path_factory.mktemp("hostile-home"),
        ) as running,
    ):
        yield running


@pytest.fixture(scope="module")
def victim(stack, tiny_model):
    return Victim(stack, stack.create_tenant_key("victim"), tiny_model.name)


@pytest.fixture(scope="module")
def attacker(stack):
    key = stack.create_tenant_key("attacker")
    return httpx.Client(
        base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


@pytest.fixture(scope="module")
def prober(stack, victim):
    probe = Prober(stack.base_url, victim.key)
    probe.start()
    yield probe
    probe.stop()
    print(f"\n/v1/models under attack: {probe.summary()}")
    assert probe.errors == 0
    # Liveness, not a speed target (bench/hostile_latency.py measures the p99): a loop
    # blocked by an attack shows up as seconds here.
    assert probe.max_s() < 2.0, probe.summary()


class Victim:
    """A tenant whose greedy stream must not change, whatever the attacker does."""

    def __init__(self, stack: Stack, key: str, model: str) -> None:
        self.stack, self.key, self.model = stack, key, model
        self.expected = self.stream()

    def stream(self) -> str:
        body = {
            "model": self.model,
            "prompt": "the victim's prompt",
            "max_tokens": VICTIM_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        text, finish = [], None
        with httpx.stream(
            "POST",
            f"{self.stack.base_url}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=60,
        ) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text.append(choice["text"])
                    finish = choice["finish_reason"] or finish
        assert finish == "length"
        return "".join(text)

    @contextlib.contextmanager
    def alongside(self) -> Iterator[None]:
        """Streams in a loop while the block runs; every stream must match the unattacked one."""
        done, results, failures = threading.Event(), [], []

        def loop() -> None:
            while True:
                try:
                    results.append(self.stream())
                except Exception as exc:  # reported below, with the attack's outcome
                    failures.append(exc)
                if done.is_set():
                    return

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        time.sleep(0.05)  # the victim's first stream is under way before the attack
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=120)
        assert not thread.is_alive(), "the victim's stream hung"
        assert not failures, failures
        assert results and all(r == self.expected for r in results)


class Prober:
    """Reads /v1/models every 20 ms in a thread and keeps every latency."""

    def __init__(self, base_url: str, key: str) -> None:
        self.client = httpx.Client(
            base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        )
        self.latencies: list[float] = []
        self.errors = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._done.is_set():
            started = time.perf_counter()
            try:
                ok = self.client.get("/v1/models").status_code == 200
            except httpx.HTTPError:
                ok = False
            self.latencies.append(time.perf_counter() - started)
            self.errors += not ok
            time.sleep(0.02)

    def max_s(self) -> float:
        return max(self.latencies, default=0.0)

    def summary(self) -> str:
        ordered = sorted(self.latencies) or [0.0]
        p50, p99 = (ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.99))
        return (
            f"{len(ordered)} probes, p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, "
            f"max {ordered[-1] * 1e3:.1f} ms"
        )


def assert_refused(response: httpx.Response, *statuses: int) -> dict:
    """A 4xx (one of `statuses` if given) whose body is OpenAI's error object."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    if statuses:
        assert response.status_code in statuses, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert "type" in error and "code" in error
    return error


# --- sampling values and request shapes -------------------------------------------------

SAMPLING_ATTACKS = {
    "repetition_penalty_near_zero": {"repetition_penalty": 1e-30},
    "repetition_penalty_huge": {"repetition_penalty": 1e30},
    "temperature_huge": {"temperature": 1e30},
    "top_p_zero": {"top_p": 0},
    "top_k_huge": {"top_k": 10**12},
    "min_p_above_one": {"min_p": 2.0},
    "presence_penalty_huge": {"presence_penalty": 1e30},
    "frequency_penalty_negative_huge": {"frequency_penalty": -1e30},
    "logprobs_huge": {"logprobs": 10**6},
    "seed_beyond_int64": {"seed": 2**70},
    "max_tokens_huge": {"max_tokens": 10**9},
    "n_huge": {"n": 10**6},
    "n_times_max_tokens": {"n": 64, "max_tokens": 400},
    "stop_strings_many": {"stop": [f"s{i}" for i in range(10_000)]},
    "stop_string_long": {"stop": ["x" * 1_000_000]},
    "stop_token_ids_many": {"stop_token_ids": list(range(100_000))},
    "stop_token_id_out_of_vocab": {"stop_token_ids": [2**31]},
    "prompt_token_ids_out_of_vocab": {"prompt": [10**9, 5]},
    "prompt_token_ids_negative": {"prompt": [-1, 5]},
    "prompt_token_ids_too_many": {"prompt": [5] * 200_000},
    "prompt_text_too_long": {"prompt": "a" * 3_000_000},
    "prompt_empty_list": {"prompt": []},
    "prompt_logprobs_huge": {"prompt_logprobs": 10**6},
    "max_tokens_zero_without_echo": {"max_tokens": 0},
    "echo_max_tokens_negative": {"echo": True, "max_tokens": -1},
    "prompt_logprobs_in_every_choice": {"prompt_logprobs": 20, "n": 64, "prompt": [5] * 400},
}


@pytest.mark.parametrize("fields", SAMPLING_ATTACKS.values(), ids=SAMPLING_ATTACKS.keys())
def test_hostile_completion_fields_fail_alone(fields, victim, attacker, prober, tiny_model):
    body = {"model": tiny_model.name, "prompt": "attack", "max_tokens": 8, **fields}
    with victim.alongside():
        response = attacker.post("/v1/completions", json=body)
    assert_refused(response)


NON_FINITE = {
    "temperature_nan": b'"temperature": NaN',
    "top_p_infinity": b'"top_p": Infinity',
    "repetition_penalty_negative_infinity": b'"repetition_penalty": -Infinity',
}


@pytest.mark.parametrize("field", NON_FINITE.values(), ids=NON_FINITE.keys())
def test_non_finite_json_numbers_are_refused(field, victim, attacker, prober, tiny_model):
    body = b'{"model": "%s", "prompt": "attack", "max_tokens": 4, %s}' % (
        tiny_model.name.encode(),
        field,
    )
    with victim.alongside():
        response = attacker.post(
            "/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )
    assert_refused(response, 400, 422)


def test_sampled_extreme_but_valid_values_still_answer(victim, attacker, prober, tiny_model):
    """The largest values the bounds allow produce an answer, not a failed step."""
    body = {
        "model": tiny_model.name,
        "prompt": "attack",
        "max_tokens": 16,
        "temperature": 2.0,
        "top_p": 1e-6,
        "repetition_penalty": 0.01,
        "presence_penalty": 2.0,
        "frequency_penalty": -2.0,
        "logprobs": 5,
    }
    with victim.alongside():
        response = attacker.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert all(lp == lp and abs(lp) != float("inf") for lp in logprobs)  # finite, not NaN


@pytest.mark.parametrize("temperature", [1e-30, 1e-6])
def test_a_tiny_temperature_is_greedy(temperature, victim, attacker, prober, tiny_model):
    """OpenAI accepts any temperature in [0, 2]; one that would overflow the logits samples
    greedily (the same text as temperature 0) instead of failing its step."""
    body = {"model": tiny_model.name, "prompt": "attack", "max_tokens": 24, "ignore_eos": True}
    greedy = attacker.post("/v1/completions", json={**body, "temperature": 0})
    with victim.alongside():
        tiny = attacker.post("/v1/completions", json={**body, "temperature": temperature})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_scoring_long_prompts_beside_the_victim(victim, attacker, prober, tiny_model):
    """The heaviest valid scoring (a prompt filling the context, 20 alternatives per prompt
    token, echoed) answers, and the victim's stream does not change."""
    body = {
        "model": tiny_model.name,
        "prompt": [3 + i % 300 for i in range(500)],
        "echo": True,
        "logprobs": 20,
        "prompt_logprobs": 20,
        "max_tokens": 0,
    }
    with victim.alongside():
        responses = [attacker.post("/v1/completions", json=body) for _ in range(3)]
    for response in responses:
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert len(choice["logprobs"]["token_logprobs"]) == 500
        assert len(choice["prompt_logprobs"]) == 500


def test_responses_it_cannot_honour_are_refused_beside_the_victim(
    victim, attacker, prober, tiny_model
):
    bodies = [
        {"previous_response_id": "resp_x"},
        {"input": [{"type": "reasoning"}] * 1000},
        {"tools": [{"type": "function", "name": "f" * 65}]},
        {"metadata": {str(i): "v" for i in range(10_000)}},
        {"input": [{"role": "user", "content": "hi"}] * 100_000},
    ]
    with victim.alongside():
        for extra in bodies:
            body = {"model": tiny_model.name, "input": "hi", **extra}
            assert_refused(attacker.post("/v1/responses", json=body), 400)


def test_chat_with_many_messages_is_refused(victim, attacker, prober, tiny_model):
    messages = [{"role": "user", "content": "hi"}] * 100_000
    with victim.alongside():
        response = attacker.post(
            "/v1/chat/completions", json={"model": tiny_model.name, "messages": messages}
        )
    assert_refused(response)


def test_deeply_nested_json_is_refused(victim, attacker, prober):
    body = b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with victim.alongside():
        response = attacker.post(
            "/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )
    assert_refused(response)


LONE = "\ud800"  # a lone UTF-16 surrogate: JSON can carry it, UTF-8 text cannot
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SURROGATE_ATTACKS = {
    "prompt": ("/v1/completions", {"prompt": f"a{LONE}"}, "prompt"),
    "stop": ("/v1/completions", {"prompt": "a", "stop": [LONE]}, "stop.0"),
    "model": ("/v1/completions", {"model": LONE, "prompt": "a"}, "model"),
    "chat_content": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": LONE}]},
        "messages.0.content",
    ),
    "tool_description": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{**TOOL, "function": {**TOOL["function"], "description": LONE}}],
        },
        "tools.0.function.description",
    ),
    "tool_call_id": (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": f"call_1{LONE}", "content": "x"},
            ]
        },
        "messages.1.tool_call_id",
    ),
    "responses_input": ("/v1/responses", {"input": LONE}, "input"),
}


@pytest.mark.parametrize(
    "path, fields, param", SURROGATE_ATTACKS.values(), ids=SURROGATE_ATTACKS.keys()
)
def test_invalid_unicode_is_400_naming_the_field(
    path, fields, param, victim, attacker, prober, tiny_model
):
    """A lone surrogate (escaped, as JSON allows) in any string: a 400 naming the field, never
    a 500 from the tokenizer, the protobuf or Redis."""
    body = json.dumps({"model": tiny_model.name, "max_tokens": 4, **fields}).encode()
    with victim.alongside():
        response = attacker.post(path, content=body, headers={"Content-Type": "application/json"})
    assert assert_refused(response, 400)["param"] == param


def test_a_tool_message_answering_no_call_is_400(victim, attacker, prober, tiny_model):
    """As OpenAI: a tool message's tool_call_id must name an earlier assistant tool call."""
    answer = {"role": "tool", "tool_call_id": "call_2", "content": "18 C"}
    for messages, index in (
        ([{"role": "user", "content": "hi"}, answer], 1),
        ([{"role": "assistant", "tool_calls": [CALL]}, answer], 1),
    ):
        body = {"model": tiny_model.name, "max_tokens": 4, "messages": messages}
        with victim.alongside():
            response = attacker.post("/v1/chat/completions", json=body)
        assert assert_refused(response, 400)["param"] == f"messages.{index}.tool_call_id"


def _wide_schema(properties: int) -> dict:
    return {
        "type": "object",
        "properties": {
            f"p_{i}": {"type": "string", "description": "x " * 8} for i in range(properties)
        },
    }


def test_large_requests_leave_the_loop_free(victim, attacker, prober, tiny_model):
    """A ~1 MB prompt, a 1,500-property schema and 64 tools go through parsing, the checks,
    templating and tokenizing (or are refused by the context) while /v1/models stays fast:
    none of that work runs on the event loop (tests/gateway/test_loop_stall.py measures the
    loop itself)."""
    salt = os.urandom(4).hex()
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"t{i}",
                "description": "does a thing " * 40,
                "parameters": _wide_schema(30),
            },
        }
        for i in range(64)
    ]
    bodies = [
        ("/v1/completions", {"prompt": "the quick brown fox " * 50_000}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "wide",
                        "schema": {**_wide_schema(1500), "title": salt},
                    },
                },
            },
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": salt}], "tools": tools}),
    ]
    before = len(prober.latencies)
    with victim.alongside():
        for path, fields in bodies:
            body = {"model": tiny_model.name, "max_tokens": 4, **fields}
            response = attacker.post(path, json=body, timeout=120)
            assert response.status_code in (200, 400), response.text[:300]
    during = prober.latencies[before:]
    print(f"\n/v1/models during large requests: max {max(during) * 1e3:.0f} ms of {len(during)}")
    assert during and max(during) < 1.0  # liveness on a loaded machine (was 0.6-2.4 s)


def test_unknown_model_strings_are_404(victim, attacker, prober):
    with victim.alongside():
        for i in range(50):
            body = {"model": f"random-{i}-{os.urandom(4).hex()}", "prompt": "x", "max_tokens": 1}
            assert_refused(attacker.post("/v1/completions", json=body), 404)


# --- bodies and connections ---------------------------------------------------------------


def _raw_exchange(port: int, head: bytes, body_chunks: Iterator[bytes]) -> bytes:
    """Sends `head`, then chunks until the server answers or closes; returns its answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        with contextlib.suppress(OSError):
            for chunk in body_chunks:
                sock.sendall(chunk)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        with contextlib.suppress(OSError):
            while data := sock.recv(65536):
                answer += data
    return answer


def _status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        size, _, rest = body.partition(b"\r\n")
        body = rest[: int(size, 16)]
    return status, json.loads(body)["error"]


def test_oversized_body_without_credentials_is_413(stack, victim, prober):
    """Refused on its Content-Length, before authentication or parsing: a client that
    declares a gigabyte and sends a few kilobytes gets its answer at once."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1073741824\r\n\r\n"
    )
    with victim.alongside():
        answer = _raw_exchange(stack.gateway_port, head, iter([b"{" + b" " * 4096]))
    status, error = _status_and_error(answer)
    assert status == 413 and error["message"]


def test_oversized_chunked_body_is_413(stack, victim, prober):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"a" * (1 << 20)
    chunks = (b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(64))
    with victim.alongside():
        answer = _raw_exchange(stack.gateway_port, head, chunks)
    status, error = _status_and_error(answer)
    assert status == 413 and error["message"]


def test_a_client_that_never_finishes_its_headers_is_dropped(stack, victim, prober):
    """Slowloris: half a request, then silence; the server closes the connection itself."""
    address = ("127.0.0.1", stack.gateway_port)
    with victim.alongside(), socket.create_connection(address, timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        # Closed by the server (end of stream, or a reset): our own 60 s timeout would raise
        # TimeoutError out of here instead.
        with contextlib.suppress(ConnectionResetError):
            while sock.recv(1024):
                pass


def _pieces_exchange(port: int, data: bytes, piece: int) -> bytes:
    """Sends `data` in `piece`-byte writes until the server answers; returns its answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for start in range(0, len(data), piece):
            if select.select([sock], [], [], 0.02)[0]:
                break  # answered: more bytes would only reset the connection
            sock.sendall(data[start : start + piece])
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                answer += chunk
    return answer


def test_the_header_limit_holds_in_one_write_and_in_pieces(stack, victim, prober):
    """A 74 KB head (5,000 headers, past the 16 KiB bound) is a 400 however it arrives."""
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
    head += b"".join(b"X-Filler-%04d: v\r\n" % i for i in range(5000)) + b"\r\n"
    with victim.alongside():
        whole = _raw_exchange(stack.gateway_port, head, iter(()))
        pieces = _pieces_exchange(stack.gateway_port, head, 4096)
    assert whole.startswith(b"HTTP/1.1 400"), whole[:200]
    assert pieces.startswith(b"HTTP/1.1 400"), pieces[:200]


def test_invalid_json_and_wrong_types_are_400(victim, attacker, prober, tiny_model):
    with victim.alongside():
        assert_refused(
            attacker.post(
                "/v1/completions",
                content=b"{not json",
                headers={"Content-Type": "application/json"},
            ),
            400,
        )
        assert_refused(
            attacker.post("/v1/completions", json={"model": tiny_model.name, "prompt": {"a": 1}}),
            400,
        )


# --- adapter uploads: archives, safetensors headers, configs, regexes, races ----------------


@pytest.fixture(scope="module")
def good_adapter(tiny_model, tmp_path_factory):
    return make_peft_adapter(
        tiny_model, tmp_path_factory.mktemp("hostile-adapter") / "a", rank=4, targets=["q_proj"]
    )


def _upload(client: httpx.Client, name: str, archive: bytes, filename: str = "a.tar.gz"):
    return client.post("/v1/adapters", data={"name": name}, files={"file": (filename, archive)})


def _with_config(adapter_dir, **changes) -> bytes:
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    config.update(changes)
    return tar_bytes(
        [
            Member("adapter_config.json", json.dumps(config).encode()),
            Member(
                "adapter_model.safetensors",
                (adapter_dir / "adapter_model.safetensors").read_bytes(),
            ),
        ]
    )


def _with_weights(adapter_dir, weights: bytes) -> bytes:
    return tar_bytes(
        [
            Member("adapter_config.json", (adapter_dir / "adapter_config.json").read_bytes()),
            Member("adapter_model.safetensors", weights),
        ]
    )


def _zip_bomb() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("adapter_config.json", b"{}")
        zf.writestr("adapter_model.safetensors", b"\0" * (600 << 20))
    return buffer.getvalue()


def _zip_with_huge_central_directory() -> bytes:
    """An end-of-central-directory record that declares a million entries."""
    archive = zip_bytes([Member("adapter_config.json", b"{}")])
    eocd = archive.rfind(b"PK\x05\x06")
    head = archive[: eocd + 8]
    return head + struct.pack("<HH", 0xFFFF, 0xFFFF) + archive[eocd + 12 :]


def _safetensors_header(length: int, header: bytes = b"{}") -> bytes:
    return struct.pack("<Q", length) + header


UPLOAD_ATTACKS: dict[str, Callable] = {
    "zip_bomb": lambda a: (_zip_bomb(), "a.zip"),
    "zip_huge_central_directory": lambda a: (_zip_with_huge_central_directory(), "a.zip"),
    "tar_path_traversal": lambda a: (
        tar_bytes([Member("../../etc/evil", b"x"), *adapter_members(a)]),
        "a.tar.gz",
    ),
    "tar_symlink": lambda a: (
        tar_bytes([Member("adapter_model.safetensors", kind="symlink", target="/etc/passwd")]),
        "a.tar.gz",
    ),
    "pickle_weights": lambda a: (
        tar_bytes(
            [
                Member("adapter_config.json", (a / "adapter_config.json").read_bytes()),
                Member("adapter_model.bin", pickle_bytes(a / "pwned")),
            ]
        ),
        "a.tar.gz",
    ),
    "safetensors_header_length_huge": lambda a: (
        _with_weights(a, _safetensors_header(2**60)),
        "a.tar.gz",
    ),
    "safetensors_header_not_json": lambda a: (
        _with_weights(a, _safetensors_header(8, b"notjson!")),
        "a.tar.gz",
    ),
    "config_rank_huge": lambda a: (_with_config(a, r=10**9), "a.tar.gz"),
    "config_alpha_huge": lambda a: (_with_config(a, lora_alpha=1e300), "a.tar.gz"),
    "config_pathological_regex": lambda a: (
        _with_config(a, target_modules="(" + "a*" * 30 + ")*b"),
        "a.tar.gz",
    ),
    "config_not_json": lambda a: (
        tar_bytes([Member("adapter_config.json", b"{" * 10_000), *adapter_members(a)[1:]]),
        "a.tar.gz",
    ),
}


@pytest.mark.parametrize("make", UPLOAD_ATTACKS.values(), ids=UPLOAD_ATTACKS.keys())
def test_hostile_uploads_fail_alone(make, good_adapter, victim, attacker, prober):
    archive, filename = make(good_adapter)
    with victim.alongside():
        response = _upload(attacker, "evil", archive, filename)
    assert_refused(response)
    assert not (good_adapter / "pwned").exists()
    listed = attacker.get("/v1/adapters").json()["data"]
    assert "evil" not in [a["id"] for a in listed]


def test_nan_weights_are_refused(good_adapter, victim, attacker, prober):
    from safetensors.numpy import load, save

    tensors = load((good_adapter / "adapter_model.safetensors").read_bytes())
    name = next(iter(tensors))
    tensors[name] = tensors[name].copy()
    tensors[name].flat[0] = float("nan")
    with victim.alongside():
        response = _upload(attacker, "nan", _with_weights(good_adapter, save(tensors)))
    assert_refused(response)


def test_racing_uploads_of_one_name_leave_one_working_adapter(
    good_adapter, tiny_model, tmp_path_factory, victim, attacker, prober
):
    other = make_peft_adapter(
        tiny_model, tmp_path_factory.mktemp("race") / "b", rank=4, targets=["v_proj"], seed=3
    )
    archives = [tar_bytes(adapter_members(d)) for d in (good_adapter, other)] * 3
    with victim.alongside():
        threads_out: list[httpx.Response] = []

        def upload(archive: bytes) -> None:
            threads_out.append(_upload(attacker, "raced", archive))

        threads = [threading.Thread(target=upload, args=(a,)) for a in archives]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    statuses = sorted(r.status_code for r in threads_out)
    assert all(s in (200, 201, 409, 429) for s in statuses), statuses
    assert any(s in (200, 201) for s in statuses)
    served = attacker.post(
        "/v1/completions", json={"model": "raced", "prompt": "x", "max_tokens": 2}
    )
    assert served.status_code == 200, served.text
    assert attacker.delete("/v1/adapters/raced").status_code == 200


# --- disconnects: the worker's tokens are charged whatever the client did ---------------------


def _completion_tokens(client: httpx.Client) -> int:
    rows = client.get("/v1/usage").json()["data"]
    return sum(r["completion_tokens"] for r in rows)


@pytest.mark.parametrize("stream", [False, True], ids=["non_streaming", "streaming"])
def test_a_client_that_leaves_still_pays(stream, stack, victim, attacker, prober, tiny_model):
    before = _completion_tokens(attacker)
    body = {
        "model": tiny_model.name,
        "prompt": "leave early",
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }
    with (
        victim.alongside(),
        contextlib.suppress(httpx.TimeoutException),
        httpx.stream(
            "POST",
            f"{stack.base_url}/v1/completions",
            json=body,
            headers=attacker.headers,
            timeout=httpx.Timeout(60, read=0.3),
        ) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # streaming: leave after the first delta
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _completion_tokens(attacker) == before:
        time.sleep(0.2)
    assert _completion_tokens(attacker) > before


# --- the worker's gRPC port -------------------------------------------------------------------


def test_grpc_callers_without_credentials_are_refused(stack, victim, prober):
    import grpc

    from rpc import worker_pb2, worker_pb2_grpc

    port = next(iter(stack.worker_ports.values()))
    with victim.alongside(), grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        calls = [
            lambda: stub.Stats(worker_pb2.StatsRequest(), timeout=5),
            lambda: list(
                stub.Generate(
                    worker_pb2.GenerateRequest(
                        request_id="x",
                        prompt_token_ids=[1, 2],
                        params=worker_pb2.SamplingParams(max_tokens=2),
                        tenant="victim",
                    ),
                    timeout=5,
                )
            ),
            lambda: stub.LoadAdapter(
                worker_pb2.LoadAdapterRequest(adapter_id="../../etc"), timeout=5
            ),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.UNAUTHENTICATED,
            )


# --- shared helpers: the grammar checkers ---------------------------------------------------


def _ref_chain(depth: int, salt: str) -> dict:
    """A schema whose `$ref` chain kills llguidance's compiler (and costs its metaschema check
    seconds); `salt` makes each one new to the checker's cache."""
    defs = {
        f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(depth)
    }
    defs[f"d{depth}"] = {"type": "string", "description": salt}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def _plain_schema_latency(stack: Stack, key: str, model: str, salt: str) -> float:
    """Seconds for one completion under a small JSON schema the checker has not seen."""
    schema = {
        "type": "object",
        "properties": {f"k_{salt}": {"type": "integer"}},
        "required": [f"k_{salt}"],
        "additionalProperties": False,
    }
    body = {
        "model": model,
        "prompt": "json please",
        "max_tokens": 8,
        "temperature": 0,
        "structured_outputs": {"json": schema},
    }
    started = time.perf_counter()
    response = httpx.post(
        f"{stack.base_url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    took = time.perf_counter() - started
    assert response.status_code == 200, response.text
    return took


def test_a_flood_of_crashing_schemas_leaves_another_tenants_schemas_fast(
    stack, victim, attacker, prober, tiny_model
):
    """40 concurrent requests, each with a new `$ref` chain that crashes its check: each gets
    its 400 (or a 429 once its tenant's queue on the checkers is full), and another tenant's
    plain JSON schema is checked beside them, not behind them."""
    salt = os.urandom(4).hex()
    latency = functools.partial(_plain_schema_latency, stack, victim.key, tiny_model.name)
    with victim.alongside():  # the victim's own stream runs in both measurements
        alone = statistics.median(latency(f"{salt}_alone_{i}") for i in range(5))
    statuses: list[int] = []

    def attack(i: int) -> None:
        body = {
            "model": tiny_model.name,
            "prompt": "attack",
            "max_tokens": 4,
            "structured_outputs": {"json": _ref_chain(2000, f"{salt}_{i}")},
        }
        response = attacker.post("/v1/completions", json=body, timeout=300)
        assert_refused(response, 400, 429)
        statuses.append(response.status_code)

    with victim.alongside():
        flood = [threading.Thread(target=attack, args=(i,)) for i in range(40)]
        for thread in flood:
            thread.start()
        time.sleep(1.0)  # the flood's checks are running and queued
        attacked = [latency(f"{salt}_attacked_{i}") for i in range(5)]
        for thread in flood:
            thread.join(timeout=300)
    print(
        f"\nvictim's schema request: alone {alone * 1e3:.0f} ms (median of 5), under the flood "
        f"{statistics.median(attacked) * 1e3:.0f} ms median, {max(attacked) * 1e3:.0f} ms max; "
        f"attacker: {statuses.count(400)} x 400, {statuses.count(429)} x 429"
    )
    assert len(statuses) == 40 and statuses.count(400) >= 1
    # Starvation, not the 2x target, is what a test on a shared 2-core runner can hold: before
    # fair checkers the victim waited 41-45 s behind the flood. The ratio is printed above and
    # reported with its command (1.25-1.3x measured); a fixed second of slack absorbs a busy CI.
    assert statistics.median(attacked) <= 2 * alone + 1.0, (alone, attacked)


# --- an adapter whose numbers overflow, on the torch attention path ---------------------------


@pytest.fixture(scope="module")
def torch_plan_stack(tiny_model, redis_url, tmp_path_factory):
    """A worker in float16 on CPU: no native kernel serves that dtype, so every attention call
    takes the torch path (blocks gathered whole, padding and tails included), the plan a
    disturbed start-up measurement also falls back to. A small KV pool (65 blocks of 16
    tokens), so that freed blocks come round again within a few requests."""
    with Stack(
        model=tiny_model,
        num_workers=1,
        redis_url=redis_url,
        gateway_port=free_port(),
        dtype="float16",
        worker_args=["--kv-cache-memory-gb", "0.00025"],
        key_prefix=f"sbhostile-f16:{os.getpid()}:",
        home=tmp_path_factory.mktemp("hostile-f16-home"),
    ) as running:
        yield running


def _overflowing(adapter_dir) -> bytes:
    """The adapter with every ``lora_B`` entry 3e38: finite (accepted, as PEFT would), but
    its rows' K/V overflow to inf and NaN."""
    import numpy as np
    from safetensors.numpy import load, save

    tensors = load((adapter_dir / "adapter_model.safetensors").read_bytes())
    for name in [k for k in tensors if "lora_B" in k]:
        tensors[name] = np.full_like(tensors[name], 3e38)
    return _with_weights(adapter_dir, save(tensors))


def test_an_adapters_nan_in_freed_kv_blocks_reaches_no_other_tenant(
    torch_plan_stack, tiny_model, tmp_path_factory
):
    stack = torch_plan_stack
    adapter = make_peft_adapter(
        tiny_model,
        tmp_path_factory.mktemp("overflow") / "a",
        rank=4,
        targets=["k_proj", "v_proj", "o_proj"],
    )
    victim = Victim(stack, stack.create_tenant_key("victim"), tiny_model.name)
    key = stack.create_tenant_key("attacker")
    with httpx.Client(
        base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60
    ) as attacker:
        assert _upload(attacker, "boom", _overflowing(adapter)).status_code == 201
        refused = []
        with victim.alongside():
            for i in range(40):  # each writes NaN into the blocks it then frees
                body = {"model": "boom", "prompt": "overflow " * (5 + i % 5), "max_tokens": 4}
                refused.append(attacker.post("/v1/completions", json=body))
        for response in refused:
            error = assert_refused(response, 400)
            assert "not numbers (NaN)" in error["message"] and "'boom'" in error["message"]
    # After the floods, on the blocks they left: the victim's answer is still the clean one.
    assert victim.stream() == victim.expected
