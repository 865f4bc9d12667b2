"""Shared pieces for the gateway tests (this module holds no tests itself).

- `make_model_dir`: a tiny checkpoint directory as the gateway reads it (tokenizer.json
  trained here with `tokenizers`, a ChatML chat template, a tiny Llama config.json); no weights.
- `write_adapter`: a real PEFT LoRA adapter directory for that config (numpy + safetensors).
- `ScriptedWorker`: a stand-in worker for gateway-only tests — a real `grpc.aio` server
  implementing the `Worker` service that streams deterministic tokens and can be told to fail
  before the first token, fail mid-stream, or stall; it records requests and cancellations.
  (End-to-end tests with the real worker live elsewhere.)
- `running_gateway`: the real app under a real uvicorn server on 127.0.0.1, in the test's loop.
- `archive_upload`, `files_upload`: multipart bodies for POST /v1/adapters; `assert_error`:
  an OpenAI-style invalid_request_error with the given status, code, param and message.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import numpy as np
import redis.asyncio as aioredis
import uvicorn
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from tokenizers import decoders as tk_decoders

from gateway.app import create_app
from gateway.settings import GatewaySettings
from rpc import worker_pb2, worker_pb2_grpc
from runtime.registry import WorkerInfo, register

ADMIN_TOKEN = "test-admin-token-0123456789abcdef"
MODEL_NAME = "tiny-chat"
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Switchboard serves many LoRA adapters on one base model.",
    "What is the capital of France? Paris is the capital of France.",
    "You are a helpful assistant. Answer briefly and politely.",
] * 20


def make_model_dir(path: Path) -> Path:
    """A checkpoint directory with everything the gateway reads, and nothing else."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "pad_token": "<|im_end|>",
                "model_max_length": TINY_CONFIG["max_position_embeddings"],
            }
        )
    )
    (path / "chat_template.jinja").write_text(CHATML)
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return path


def write_adapter(path: Path, *, rank: int = 4, seed: int = 0, config: dict | None = None) -> Path:
    """A PEFT LoRA adapter on q_proj/v_proj of the tiny config (or ``config``), as
    `save_pretrained` writes it."""
    base = config or TINY_CONFIG
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hidden = base["hidden_size"]
    head_dim = hidden // base["num_attention_heads"]
    out = {"q_proj": hidden, "v_proj": base["num_key_value_heads"] * head_dim}
    tensors = {}
    for layer in range(base["num_hidden_layers"]):
        for module, out_features in out.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.standard_normal((rank, hidden), np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.standard_normal((out_features, rank), np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


class Mode(enum.Enum):
    OK = "ok"
    FAIL_BEFORE_FIRST = "fail_before_first"  # UNAVAILABLE before any response
    FAIL_MID_STREAM = "fail_mid_stream"  # INTERNAL after `fail_after` responses
    STALL = "stall"  # one response, then waits forever (until cancelled)


@dataclass
class ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    """A real gRPC Worker that streams `pieces` one token per message, per sample."""

    name: str
    pieces: tuple[str, ...] = ("Hello", ",", " world", "!")
    mode: Mode = Mode.OK
    fail_after: int = 2
    requests: list[worker_pb2.GenerateRequest] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)  # adapter ids, in order
    loaded: list[str] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    # False: a worker from before GenerateAll, which answers it UNIMPLEMENTED.
    answers_unary: bool = True
    unary_tail_s: float = 0.0  # GenerateAll waits this long after its last delta
    first_token_delay_s: float = 0.0  # a prefill's time: the wait before the first delta
    rpcs: list[str] = field(default_factory=list)  # the Generate* calls, in order
    address: str = ""
    _server: grpc.aio.Server | None = None

    async def Generate(self, request, context):
        self.requests.append(request)
        self.rpcs.append("Generate")
        try:
            async for message in self._script(request, context):
                yield message
        except asyncio.CancelledError:
            self.cancelled.set()  # the gateway cancelled the call
            raise

    async def GenerateAll(self, request, context):
        if not self.answers_unary:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        self.requests.append(request)
        self.rpcs.append("GenerateAll")
        responses, first_at = [], None
        try:
            async for message in self._script(request, context):
                first_at = first_at or time.monotonic()
                responses.append(message)
            await asyncio.sleep(self.unary_tail_s)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return worker_pb2.GenerateAllResponse(
            responses=responses, first_token_to_end_s=time.monotonic() - first_at
        )

    async def LoadAdapter(self, request, context):
        self.loaded.append(request.adapter_id)
        return worker_pb2.LoadAdapterResponse(adapter_id=request.adapter_id)

    async def UnloadAdapter(self, request, context):
        self.unloaded.append(request.adapter_id)
        return worker_pb2.UnloadAdapterResponse()

    async def _script(self, request, context):
        if self.mode is Mode.FAIL_BEFORE_FIRST:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is going away")
        params = request.params
        n = max(params.n, 1)
        steps = min(params.max_tokens, len(self.pieces))
        finish = "length" if params.max_tokens < len(self.pieces) else "stop"
        sent = 0
        await asyncio.sleep(self.first_token_delay_s)
        for step in range(steps):
            for index in range(n):
                if self.mode is Mode.FAIL_MID_STREAM and sent == self.fail_after:
                    await context.abort(grpc.StatusCode.INTERNAL, f"{self.name} crashed")
                if self.mode is Mode.STALL and sent == 1:
                    await asyncio.Event().wait()  # until the gateway cancels the call
                last = step == steps - 1
                yield self._response(request, index, step, finish if last else "")
                sent += 1

    def _response(self, request, index: int, step: int, finish: str):
        token_id = 100 + step
        message = worker_pb2.GenerateResponse(
            index=index,
            token_ids=[token_id],
            text=self.pieces[step],
            finish_reason=finish,
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=step + 1,
        )
        if request.params.HasField("logprobs"):
            top = [
                worker_pb2.TopLogprob(token_id=token_id + k, logprob=-0.25 - k)
                for k in range(request.params.logprobs)
            ]
            # The last of n samples is the most likely one (what best_of must pick).
            logprob = -0.25 * (max(request.params.n, 1) - index)
            message.logprobs.append(
                worker_pb2.TokenLogprob(token_id=token_id, logprob=logprob, top=top)
            )
        return message

    def text(self, n_tokens: int | None = None) -> str:
        return "".join(self.pieces[:n_tokens])

    async def start(self) -> ScriptedWorker:
        self._server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        await self._server.start()
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)

    async def register(
        self,
        redis: aioredis.Redis,
        prefix: str,
        *,
        adapters: tuple[str, ...] = (),
        running: int = 0,
        model: str = MODEL_NAME,
        ttl: float = 30,
    ) -> None:
        info = WorkerInfo(
            worker_id=self.name,
            address=self.address,
            model=model,
            adapters=list(adapters),
            running=running,
            heartbeat_at=time.time(),
        )
        await register(redis, prefix, info, ttl=ttl)


def gateway_settings(
    *, redis_url: str, prefix: str, model_dir: Path, store: Path, **overrides
) -> GatewaySettings:
    values = {
        "redis_url": redis_url,
        "key_prefix": prefix,
        "admin_token": ADMIN_TOKEN,
        "model": model_dir,
        "served_model_name": MODEL_NAME,
        "adapter_store": store,
        "port": 0,
        "worker_cache_s": 0.0,
        "request_timeout_s": 10.0,
    }
    return GatewaySettings(**{**values, **overrides})


@dataclass
class RunningGateway:
    url: str
    settings: GatewaySettings

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@contextlib.asynccontextmanager
async def running_gateway(settings: GatewaySettings) -> AsyncIterator[RunningGateway]:
    """The app under uvicorn on 127.0.0.1 (a free port), in this event loop."""
    config = uvicorn.Config(
        create_app(settings), host="127.0.0.1", port=0, log_level="warning", lifespan="on"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()  # re-raise a failed start
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield RunningGateway(url=f"http://127.0.0.1:{port}", settings=settings)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=10)


async def delete_prefix(redis_url: str, prefix: str) -> None:
    """Remove every key a test wrote (they all share its prefix)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        # Parametrized test names put [ ] in the prefix: escape glob characters.
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + "*"
        keys = [k async for k in client.scan_iter(match=pattern)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@dataclass
class LiveGateway:
    """A running gateway, a registered ScriptedWorker, a Redis client and tenants' keys."""

    gw: RunningGateway
    worker: ScriptedWorker
    redis: aioredis.Redis
    prefix: str
    keys: dict[str, str]


async def create_tenant_key(gw: RunningGateway, tenant: str) -> str:
    # 30 s, not httpx's 5: a fresh gateway's first calls on a loaded 2-core machine took longer.
    async with httpx.AsyncClient(base_url=gw.url, headers=gw.admin_headers, timeout=30) as admin:
        await admin.post("/admin/tenants", json={"name": tenant})
        return (await admin.post(f"/admin/tenants/{tenant}/keys")).json()["key"]


@contextlib.asynccontextmanager
async def gateway_with_worker(
    settings: GatewaySettings, *, tenants: tuple[str, ...] = ("acme",)
) -> AsyncIterator[LiveGateway]:
    """`running_gateway` plus a ScriptedWorker in the registry and a key per tenant; every
    key under the settings' prefix is deleted afterwards. The worker registers once, with
    no heartbeats after: its record lives as long as the settings' heartbeat TTL allows."""
    worker = await ScriptedWorker("w1").start()
    redis = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        await worker.register(redis, settings.key_prefix, ttl=settings.worker_heartbeat_ttl_s)
        async with running_gateway(settings) as gw:
            keys = {tenant: await create_tenant_key(gw, tenant) for tenant in tenants}
            yield LiveGateway(gw, worker, redis, settings.key_prefix, keys)
    finally:
        await worker.stop()
        await delete_prefix(settings.redis_url, settings.key_prefix)
        await redis.aclose()


# --- adapter uploads ---------------------------------------------------------------------


def archive_upload(name: str, data: bytes, filename: str = "adapter.tar.gz") -> dict:
    return {"data": {"name": name}, "files": {"file": (filename, data, "application/octet-stream")}}


def files_upload(name: str, adapter: Path) -> dict:
    return {
        "data": {"name": name},
        "files": {
            "adapter_config": (
                "adapter_config.json",
                (adapter / "adapter_config.json").read_bytes(),
            ),
            "adapter_model": (
                "adapter_model.safetensors",
                (adapter / "adapter_model.safetensors").read_bytes(),
            ),
        },
    }


def assert_error(response: httpx.Response, status: int, *, code=None, param=None, says=""):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    assert says in error["message"], error["message"]
    return error
