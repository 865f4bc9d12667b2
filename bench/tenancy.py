"""Tenancy costs: quota decisions per second and the latency they add, and how long a new
adapter takes from upload to its first token.

1. Admission decisions without HTTP (one process, local Redis): authenticate the key,
   resolve the adapter, admit against a tenant with all four limits set (high enough that
   every request is admitted, so each decision does all its bookkeeping), then settle; C
   concurrent callers for D seconds: decisions/s. Then one caller at a time: the latency of
   the quota check (`admit`) and of `settle` (p50/p99): what quotas add to a request.
2. Admission through HTTP: one gateway process, a tenant whose RPM limit is spent, C
   concurrent clients posting chat requests for D seconds: each is authenticated,
   tokenized and refused by the quota script (429) without reaching a worker: decisions/s
   of the whole admission path, load generator on the same 2 cores.
3. Upload to first token: a stack with the default model; for each of N fresh rank-16
   adapters (all seven projections, all layers, random weights, fp32 safetensors), the time
   from starting `POST /v1/adapters` to the first streamed token of a chat request on it,
   split into upload and first-token parts; the base model's TTFT on the same prompt for
   reference.
Usage: ``python -m bench.tenancy [--seconds 5] [--concurrency 64] [--adapters 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import redis.asyncio as aioredis
import uvloop
from safetensors.numpy import save_file

from bench.http_load import hammer, post_request
from bench.report import write_report
from gateway.tenancy.quotas import Quota, QuotaService, Reservation
from gateway.tenancy.tenants import TenantAdapter, TenantStore
from gateway.tenancy.usage import UsageDelta
from runtime.embedded_redis import EmbeddedRedis, free_port
from runtime.stack import Stack, reachable_redis

CHAT = [{"role": "user", "content": "Name three colours."}]


def percentiles(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": float(np.percentile(values, 50) * 1e3),
        "p99_ms": float(np.percentile(values, 99) * 1e3),
        "max_ms": float(np.max(values) * 1e3),
    }


async def quota_decisions(redis_url: str, *, concurrency: int, seconds: float) -> dict:
    """The gateway's admission decision without HTTP: authenticate the key, resolve the
    adapter name, admit against all four limits; then settle (refund, release, usage)."""
    client = aioredis.Redis(
        connection_pool=aioredis.BlockingConnectionPool.from_url(
            redis_url, max_connections=concurrency, decode_responses=True
        )
    )
    prefix = f"sbbench:{uuid.uuid4().hex[:8]}:"
    tenants = TenantStore(client, prefix=prefix)
    await tenants.create_tenant("bench")
    key = (await tenants.create_key("bench")).key
    record = TenantAdapter(name="sql", adapter_id="0" * 64, created_at=0)
    await tenants.add_adapter("bench", record)
    service = QuotaService(client, prefix=prefix, lease_s=60, fail_open=False)
    big = 10**12
    quota = Quota(
        requests_per_minute=big, tokens_per_minute=big, max_concurrent_requests=big,
        daily_tokens=big,
    )  # fmt: skip
    await service.set_quota("bench", quota)
    usage = UsageDelta(model="sql", prompt_tokens=20, completion_tokens=30)

    async def decide() -> Reservation:
        caller = await tenants.authenticate(key)
        await tenants.get_adapter(caller.tenant, "sql")
        return await service.admit(caller.tenant, request_id=uuid.uuid4().hex, tokens=100)

    decisions = 0
    deadline = time.monotonic() + seconds

    async def caller_loop() -> None:
        nonlocal decisions
        while time.monotonic() < deadline:
            reservation = await decide()
            await service.settle(reservation, used_tokens=50, usage=usage)
            decisions += 1

    start = time.monotonic()
    await asyncio.gather(*(caller_loop() for _ in range(concurrency)))
    rate = decisions / (time.monotonic() - start)

    decide_s, admit_s, settle_s = [], [], []
    for _ in range(2000):
        t0 = time.perf_counter()
        await tenants.authenticate(key)
        t1 = time.perf_counter()
        reservation = await service.admit("bench", request_id=uuid.uuid4().hex, tokens=100)
        t2 = time.perf_counter()
        await service.settle(reservation, used_tokens=50, usage=usage)
        admit_s.append(t2 - t1)
        decide_s.append(t2 - t0)
        settle_s.append(time.perf_counter() - t2)
    keys = [k async for k in client.scan_iter(match=prefix + "*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()
    return {
        "decisions_per_s": rate,
        "concurrency": concurrency,
        "quota_admit_latency": percentiles(admit_s),
        "auth_and_admit_latency": percentiles(decide_s),
        "settle_latency": percentiles(settle_s),
    }


async def http_admissions(stack: Stack, key: str, *, concurrency: int, seconds: float) -> dict:
    stack.admin("PUT", "/tenants/bench/quotas", json={"requests_per_minute": 1})
    request = post_request(
        "/v1/chat/completions",
        {"model": stack.model.name, "messages": CHAT, "max_tokens": 1},
        key=key,
    )
    counts, elapsed = await hammer(
        stack.gateway_port, request, concurrency=concurrency, seconds=seconds
    )
    stack.admin("PUT", "/tenants/bench/quotas", json={})
    return {
        "decisions_per_s": sum(counts.values()) / elapsed,
        "statuses": {str(k): v for k, v in counts.items()},
        "concurrency": concurrency,
    }


def write_rank16_adapter(path: Path, config: dict, *, seed: int) -> Path:
    """A PEFT adapter for the base model: rank 16 on all seven projections of every layer."""
    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {
        "self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv), "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }  # fmt: skip
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            a = rng.standard_normal((16, fan_in), np.float32) / np.float32(np.sqrt(fan_in))
            tensors[f"{name}.lora_A.weight"] = a
            b = rng.standard_normal((fan_out, 16), np.float32) * np.float32(0.01)
            tensors[f"{name}.lora_B.weight"] = b
    save_file(tensors, str(path / "adapter_model.safetensors"))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 16, "lora_alpha": 32,
                   "target_modules": targets, "bias": "none"}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(peft_config))
    return path


async def first_token_s(client: httpx.AsyncClient, model: str) -> float:
    start = time.monotonic()
    body = {"model": model, "messages": CHAT, "max_tokens": 8, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.monotonic() - start
    raise RuntimeError("no token came back")


async def upload_to_first_token(stack: Stack, key: str, *, adapters: int, tmp: Path) -> dict:
    config = json.loads((stack.model / "config.json").read_text())
    headers = {"Authorization": f"Bearer {key}"}
    rows = []
    async with httpx.AsyncClient(base_url=stack.base_url, headers=headers, timeout=120) as client:
        base = [await first_token_s(client, stack.model.name) for _ in range(3)]
        for i in range(adapters):
            directory = write_rank16_adapter(tmp / f"a{i}", config, seed=1000 + i)
            files = {
                name: (name, (directory / f"adapter_{part}").read_bytes())
                for name, part in (
                    ("adapter_config", "config.json"), ("adapter_model", "model.safetensors")
                )
            }  # fmt: skip
            start = time.monotonic()
            created = await client.post("/v1/adapters", data={"name": f"new-{i}"}, files=files)
            if created.status_code != 201:
                raise RuntimeError(f"upload refused: {created.text}")
            uploaded = time.monotonic() - start
            first = await first_token_s(client, f"new-{i}")
            rows.append({"upload_s": uploaded, "first_token_s": first, "total_s": uploaded + first})
    size = (tmp / "a0" / "adapter_model.safetensors").stat().st_size
    totals = [r["total_s"] for r in rows]
    return {
        "adapter_bytes": size,
        "upload_to_first_token": percentiles(totals),
        "upload": percentiles([r["upload_s"] for r in rows]),
        "first_token_after_upload": percentiles([r["first_token_s"] for r in rows]),
        "base_model_ttft": percentiles(base),
        "runs": rows,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=5)
    parser.add_argument("--out", default="bench/results/tenancy.json")
    args = parser.parse_args(argv)
    from worker.model.default_model import resolve_model_path

    report: dict = {}
    embedded = None
    redis_url = reachable_redis()
    if redis_url is None:
        embedded = EmbeddedRedis().start()
        redis_url = embedded.url
    try:
        # uvloop, as in the gateway process (uvicorn picks it).
        report["quota_decisions"] = uvloop.run(
            quota_decisions(redis_url, concurrency=args.concurrency, seconds=args.seconds)
        )
        print(json.dumps(report, indent=1), flush=True)
        prefix = f"sbbench:{uuid.uuid4().hex[:8]}:"
        with tempfile.TemporaryDirectory() as tmp, Stack(
            model=resolve_model_path(None), gateway_port=free_port(), redis_url=redis_url,
            key_prefix=prefix, home=Path(tmp) / "home",
            worker_args=["--max-lora-rank", "16"],
        ) as stack:  # fmt: skip
            key = stack.create_tenant_key("bench")
            report["upload_to_first_token"] = asyncio.run(
                upload_to_first_token(stack, key, adapters=args.adapters, tmp=Path(tmp))
            )
            print(json.dumps(report["upload_to_first_token"], indent=1), flush=True)
            report["http_admissions"] = asyncio.run(
                http_admissions(stack, key, concurrency=args.concurrency, seconds=args.seconds)
            )
            print(json.dumps(report["http_admissions"], indent=1), flush=True)
    finally:
        if embedded is not None:
            embedded.stop()
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
