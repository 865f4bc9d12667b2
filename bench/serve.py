"""Serving latency and throughput: through the gateway vs straight to the worker's gRPC.

Starts its own stack (embedded or local Redis, one worker, the gateway) on free ports.
Load A: N streaming requests at once (token-id prompts, ignore_eos), first through the
gateway's OpenAI API (/v1/completions, SSE), then the same requests directly over the
worker's gRPC Generate, in the same run: output tok/s, TTFT and inter-token latency
p50/p99; the TTFT difference is what the gateway adds. Load B (admission and routing):
``max_tokens=1`` requests from C concurrent keep-alive clients for D seconds against a stack
whose worker runs a 1-layer model (so the worker is not the bottleneck): authenticated
requests/s. Load C: load A's comparison (N streams, 32/64 tokens) against that fast worker,
where the gateway's own per-token cost is not hidden in engine queueing. Load D
(gateway-added latency at C concurrent streams): C/2 closed-loop pairs on the real model
for D seconds, each pair one request through the gateway and the same one straight to the
worker's gRPC at the same instant: the gateway's TTFT minus the direct one, per pair, and
the difference of their inter-token percentiles, are what the gateway adds; over the same
load the gateway's own histogram (``switchboard_gateway_added_seconds``: arrival to the
Generate call, worker message to SSE bytes) gives its share without the engine steps a
later request can miss.
Usage: ``python -m bench.serve [--requests 64] [--out bench/results/serve.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.http_load import hammer, post_request, stream_events
from bench.report import write_report
from bench.workloads import fixed_lengths
from runtime.embedded_redis import free_port
from runtime.stack import Stack


@dataclass
class Timing:
    ttft: float
    itls: list[float]
    tokens: int
    overhead_ms: float | None = None  # the gateway's x-switchboard-overhead-ms


@dataclass
class LoadResult:
    name: str
    requests: int
    output_tok_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    # Through the gateway: its own time per request, from x-switchboard-overhead-ms.
    overhead_p50_ms: float | None = None
    overhead_p99_ms: float | None = None


async def via_grpc(stub, request) -> Timing:
    """Stamps the responses the gateway would relay: the detokenizer may hold a token's
    text back (partial UTF-8, a possible stop string), and the gateway sends no chunk then."""
    start = time.monotonic()
    stamps = []
    async for response in stub.Generate(request):
        if response.text or response.finish_reason or response.logprobs:
            stamps.extend([time.monotonic()] * max(1, len(response.token_ids)))
    return Timing(stamps[0] - start, list(np.diff(stamps)), len(stamps))


async def via_lean_http(connection, request: bytes) -> Timing:
    """Through the gateway with the hand-written client of ``bench.http_load``: httpx's
    own cost per request (~2.7 ms here at idle) would otherwise count as the gateway's."""
    start = time.monotonic()
    events = await stream_events(*connection, request)
    stamps = events.stamps
    return Timing(stamps[0] - start, list(np.diff(stamps)), len(stamps), events.overhead_ms)


def summarize(name: str, timings: list[Timing], elapsed: float) -> LoadResult:
    ttft = [t.ttft * 1e3 for t in timings]
    itl = [x * 1e3 for t in timings for x in t.itls]
    overhead = [t.overhead_ms for t in timings if t.overhead_ms is not None]
    return LoadResult(
        name=name,
        requests=len(timings),
        output_tok_per_s=sum(t.tokens for t in timings) / elapsed,
        ttft_p50_ms=float(np.percentile(ttft, 50)),
        ttft_p99_ms=float(np.percentile(ttft, 99)),
        itl_p50_ms=float(np.percentile(itl, 50)),
        itl_p99_ms=float(np.percentile(itl, 99)),
        overhead_p50_ms=float(np.percentile(overhead, 50)) if overhead else None,
        overhead_p99_ms=float(np.percentile(overhead, 99)) if overhead else None,
    )


async def load_a(
    stack: Stack, key: str, model: str, num: int, vocab: int, *, prompt_len=128, output_len=128
) -> list[LoadResult]:
    from rpc import worker_pb2, worker_pb2_grpc

    requests = fixed_lengths(num, prompt_len=prompt_len, output_len=output_len, vocab=vocab, seed=3)
    bodies = [
        {"model": model, "prompt": r.prompt_token_ids, "max_tokens": r.output_len,
         "temperature": 0, "ignore_eos": True, "stream": True}
        for r in requests
    ]  # fmt: skip

    async def one(body: dict) -> Timing:
        connection = await asyncio.open_connection("127.0.0.1", stack.gateway_port)
        try:
            return await via_lean_http(connection, post_request("/v1/completions", body, key=key))
        finally:
            connection[1].close()

    await one({**bodies[0], "max_tokens": 4})  # warm-up
    start = time.monotonic()
    gateway = await asyncio.gather(*(one(b) for b in bodies))
    gateway_result = summarize("gateway (OpenAI SSE)", gateway, time.monotonic() - start)
    worker_id = next(iter(stack.worker_ports))
    # Over the same mutual TLS as the gateway's calls, so the comparison stays like for like.
    async with stack.worker_channel(worker_id, aio=True) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        messages = [
            worker_pb2.GenerateRequest(
                request_id=f"direct-{i}",
                prompt_token_ids=r.prompt_token_ids,
                params=worker_pb2.SamplingParams(
                    max_tokens=r.output_len, temperature=0, ignore_eos=True, n=1
                ),
            )
            for i, r in enumerate(requests)
        ]
        start = time.monotonic()
        direct = await asyncio.gather(*(via_grpc(stub, m) for m in messages))
        direct_result = summarize("worker gRPC direct", direct, time.monotonic() - start)
    return [gateway_result, direct_result]


async def load_d(
    stack: Stack, key: str, model: str, concurrency: int, seconds: float, vocab: int,
    *, prompt_len: int = 128, output_len: int = 128,
) -> dict:  # fmt: skip
    """Closed loop of ``concurrency`` streams as ``concurrency / 2`` pairs: each pair sends
    the same prompt through the gateway and straight to the worker at the same instant.

    Both requests of a pair usually join the same engine step, so the difference of their
    TTFTs is what the gateway added (a step later when that delay made it miss the step;
    that counts too); distributions of TTFT alone vary by whole steps and would bury it.
    Pairs start 100 ms apart (a steady state, not load A's burst); a pair that starts
    before ``seconds`` runs to the end.
    """

    from rpc import worker_pb2, worker_pb2_grpc

    worker_id = next(iter(stack.worker_ports))
    timings: dict[str, list[Timing]] = {"gateway": [], "direct": []}
    ttft_added: list[float] = []
    rng = np.random.default_rng(5)
    async with stack.worker_channel(worker_id, aio=True) as channel:  # mutual TLS
        stub = worker_pb2_grpc.WorkerStub(channel)
        params = {"max_tokens": output_len, "temperature": 0, "ignore_eos": True}
        deadline = time.monotonic() + seconds

        async def pair_loop(slot: int) -> None:
            await asyncio.sleep(slot * 0.1)
            connection = await asyncio.open_connection("127.0.0.1", stack.gateway_port)
            turn = 0
            while time.monotonic() < deadline:
                prompt = rng.integers(0, vocab, prompt_len).tolist()
                body = {"model": model, "prompt": prompt, "stream": True, **params}
                message = worker_pb2.GenerateRequest(
                    request_id=f"paired-{slot}-{turn}",
                    prompt_token_ids=prompt,
                    params=worker_pb2.SamplingParams(n=1, **params),
                )
                request = post_request("/v1/completions", body, key=key)
                gateway, direct = await asyncio.gather(
                    via_lean_http(connection, request), via_grpc(stub, message)
                )
                timings["gateway"].append(gateway)
                timings["direct"].append(direct)
                ttft_added.append((gateway.ttft - direct.ttft) * 1e3)
                turn += 1
            connection[1].close()

        start = time.monotonic()
        scraped = gateway_added_buckets(stack.gateway_port, admin_token=stack.admin_token)
        await asyncio.gather(*(pair_loop(slot) for slot in range(concurrency // 2)))
        elapsed = time.monotonic() - start
        after = gateway_added_buckets(stack.gateway_port, admin_token=stack.admin_token)
        internal = bucket_quantiles(scraped, after)
    gateway = summarize("gateway, paired", timings["gateway"], elapsed)
    direct = summarize("direct, paired", timings["direct"], elapsed)
    return {
        "results": [asdict(gateway), asdict(direct)],
        "concurrency": concurrency,
        "pairs": len(ttft_added),
        "gateway_added_ms": {
            "ttft_p50": float(np.percentile(ttft_added, 50)),
            "ttft_p99": float(np.percentile(ttft_added, 99)),
            "itl_p50": gateway.itl_p50_ms - direct.itl_p50_ms,
            "itl_p99": gateway.itl_p99_ms - direct.itl_p99_ms,
        },
        # Timed inside the gateway over the same load: its own share, which the pairs'
        # difference mixes with the engine steps a later request can miss.
        "gateway_internal_ms": internal,
    }


def gateway_added_buckets(port: int, *, admin_token: str) -> dict[str, dict[float, float]]:
    """The gateway's own-time histogram (``switchboard_gateway_added_seconds``) as
    cumulative counts per bucket bound, by phase, scraped from its /metrics (HTTP port:
    the admin token's)."""
    from urllib.request import Request, urlopen

    from prometheus_client.parser import text_string_to_metric_families

    request = Request(
        f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {admin_token}"}
    )
    text = urlopen(request, timeout=10).read().decode()
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "switchboard_gateway_added_seconds_bucket":
                phase = buckets.setdefault(sample.labels["phase"], {})
                phase[float(sample.labels["le"])] = sample.value
    return buckets


def bucket_quantiles(
    before: dict[str, dict[float, float]], after: dict[str, dict[float, float]]
) -> dict[str, float]:
    """p50 and p99 (ms) of what was observed between two scrapes, as bucket upper bounds
    (a histogram tells no finer than its buckets: 0.25, 0.5, 1, 2, 3, 5, 7.5, 10 ms ...)."""
    out: dict[str, float] = {}
    for phase, counts in after.items():
        delta = {le: n - before.get(phase, {}).get(le, 0.0) for le, n in sorted(counts.items())}
        total = delta.get(float("inf"), 0.0)
        for q in (50, 99):
            bound = next((le for le, n in delta.items() if total and n >= total * q / 100), None)
            out[f"{phase}_p{q}_at_most"] = bound * 1e3 if bound is not None else float("nan")
        out[f"{phase}_count"] = total
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc), all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load_b(stack: Stack, key: str, model: str, concurrency: int, seconds: float) -> dict:
    """Admission and routing: `max_tokens=1` completions on keep-alive connections.

    The gateway shares the 2 cores with the worker, Redis and the load generator, so it
    rarely gets a whole core; its own CPU time gives what one process does per core-second.
    """
    body = {"model": model, "prompt": [100, 200, 300], "max_tokens": 1}
    request = post_request("/v1/completions", body, key=key)
    gateway_cpu = cpu_seconds(stack.gateway.pid)
    counts, elapsed = await hammer(
        stack.gateway_port, request, concurrency=concurrency, seconds=seconds
    )
    gateway_cpu = cpu_seconds(stack.gateway.pid) - gateway_cpu
    done = counts.get(200, 0)
    return {"requests_per_s": done / elapsed, "requests": done,
            "errors": sum(counts.values()) - done, "concurrency": concurrency,
            "seconds": elapsed, "gateway_cpu_share": gateway_cpu / elapsed,
            "requests_per_gateway_cpu_s": done / gateway_cpu}  # fmt: skip


def tiny_model(base: Path, out: Path) -> Path:
    """A 1-layer random model sharing the base model's tokenizer: a worker that is fast."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(base)
    config.num_hidden_layers, config.hidden_size, config.intermediate_size = 1, 64, 128
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 32
    LlamaForCausalLM(config).save_pretrained(out)
    for f in base.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", default="bench/results/serve.json")
    parser.add_argument(
        "--fast-worker-only", action="store_true", help="loads B and C only (skip A and D)"
    )
    parser.add_argument(
        "--paired-only", action="store_true", help="load D only (real model, closed loop)"
    )
    parser.add_argument("--paired-seconds", type=float, default=60.0)
    parser.add_argument("--paired-output-len", type=int, default=64)
    parser.add_argument(
        "--worker-nice", type=int, default=0,
        help="run the worker at this nice value (the gateway keeps 0): how the gateway fares "
        "when it is not queued behind the engine for a core, as on a node of its own",
    )  # fmt: skip
    args = parser.parse_args(argv)
    from worker.model.default_model import resolve_model_path

    model_path = resolve_model_path(None)
    report: dict = {}
    prefix = f"sbbench:{uuid.uuid4().hex[:8]}:"  # a fresh namespace in a shared Redis
    if not args.fast_worker_only:
        with Stack(
            model=model_path, gateway_port=free_port(), key_prefix=prefix + "a:",
            worker_nice=args.worker_nice,
        ) as stack:  # fmt: skip
            key = stack.create_tenant_key("bench")
            if not args.paired_only:
                results = asyncio.run(load_a(stack, key, model_path.name, args.requests, 49152))
                report["load_a"] = [asdict(r) for r in results]
                report["gateway_added_ttft_ms"] = {
                    "p50": results[0].ttft_p50_ms - results[1].ttft_p50_ms,
                    "p99": results[0].ttft_p99_ms - results[1].ttft_p99_ms,
                }
            report["load_d"] = asyncio.run(
                load_d(
                    stack, key, model_path.name, args.concurrency, args.paired_seconds, 49152,
                    output_len=args.paired_output_len,
                )
            )  # fmt: skip
            print(json.dumps(report, indent=1), flush=True)
    if args.paired_only:
        return write_report(report, args.out)
    with tempfile.TemporaryDirectory() as tmp, Stack(
        model=tiny_model(model_path, Path(tmp) / "tiny"), gateway_port=free_port(),
        dtype="float32", key_prefix=prefix + "b:",
    ) as stack:  # fmt: skip
        key = stack.create_tenant_key("bench")
        report["load_b"] = asyncio.run(load_b(stack, key, "tiny", args.concurrency, args.seconds))
        print(json.dumps(report["load_b"]), flush=True)
        # Load C: what the gateway adds per token when the engine is not the bottleneck.
        fast = asyncio.run(
            load_a(stack, key, "tiny", args.requests, 49152, prompt_len=32, output_len=64)
        )
        report["load_c"] = [asdict(r) for r in fast]
        report["gateway_added_fast_worker_ms"] = {
            "ttft_p50": fast[0].ttft_p50_ms - fast[1].ttft_p50_ms,
            "ttft_p99": fast[0].ttft_p99_ms - fast[1].ttft_p99_ms,
            "itl_p50": fast[0].itl_p50_ms - fast[1].itl_p50_ms,
            "itl_p99": fast[0].itl_p99_ms - fast[1].itl_p99_ms,
        }
        print(json.dumps(report["gateway_added_fast_worker_ms"]), flush=True)
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
