"""The Batch API beside interactive traffic, through the real stack (issue 59).

One run starts a stack (Redis, one worker on the default model, the gateway) and measures:

1. Interactive latency without and with a batch running: tenant `chat` keeps `--chat-streams`
   streaming chats in flight (closed loop, `--chat-tokens` each, ignore_eos) for `--seconds`,
   first on an otherwise idle worker, then while tenant `bulk` runs a batch of `--lines`
   lines (`--batch-tokens` each; its lines started before the window opens). TTFT p50/p99 and
   TPOT p50 of each, their ratios (target: within 10%), and the batch's lines finished in the
   window (what it got of the machine beside the chats). Apart: each stream's first request
   of the window (it comes after a quiet spell), and the p50/p99 of the others.
2. Batch throughput on an idle worker: a batch of `--throughput-lines` lines from upload to
   `completed`, in output tokens/s, against the offline engine (`worker.LLM`, the worker's
   engine settings) on the same prompts in this process, `--repeats` turns of each taken
   alternately (fresh prompts each turn), the median of the turns' ratios (target: at least
   90%). The batch's end is read from its stored status in Redis, every 0.5 s and every 10 ms
   over its last lines (the API asked that often would itself take gateway CPU from the
   worker's cores, a 10 ms poll throughout this process's); each turn reports the
   CPU seconds of the gateway, the worker and the offline engine, and the gateway's per line.
   Between them, the same engine in this process as the worker runs the lines (the batch
   band, `--lines-in-flight` lines kept in flight as the runner keeps them, the same prompts):
   the served batch against it is what serving costs, it against the offline engine what the
   band and the lines' arrivals cost. ``--throughput-only`` runs this part alone.

Prompts are seeded random whole-word prompts (`--prompt-tokens`, chat template included), one
per line, so the prefix cache makes none of them free.
Usage: ``python -m bench.batch [--lines 1000] [--seconds 30] [--throughput-only] [--quick]
[--out bench/results/batch.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import time
import uuid
from collections import deque
from pathlib import Path

import httpx
import numpy as np
import redis

from bench.fairness import Prompts
from bench.http_load import post_request, stream_events
from bench.report import write_report
from gateway.tenancy.quotas import tenant_key
from runtime.embedded_redis import free_port
from runtime.home import default_model_dir
from runtime.stack import Stack

TARGETS = {"interactive_slowdown": 1.10, "batch_over_offline": 0.90}
# Lines left when the end-watch starts polling every 10 ms (at most a second of work here).
NEAR_END_LINES = 16


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def chat_window(
    port: int, key: str, model: str, prompts: Prompts, *, streams: int, tokens: int,
    prompt_tokens: int, seconds: float,
) -> dict:  # fmt: skip
    """`streams` closed-loop streaming chats for `seconds`: TTFT and TPOT of those started in
    the window. Each stream's first request comes after a quiet spell (it is the only kind
    that may find a step of batch work alone in flight, a whole step long); the rest arrive
    just after their stream's previous answer. Both are reported apart too."""
    ttft: list[float] = []
    first: list[float] = []  # each stream's first request
    steady: list[float] = []  # the others
    tpot: list[float] = []
    errors = 0
    end = time.monotonic() + seconds

    async def loop() -> None:
        nonlocal errors
        connection = await asyncio.open_connection("127.0.0.1", port)
        answered = 0
        while time.monotonic() < end:
            prompt = prompts.long(prompt_tokens)
            body = {
                "model": model, "messages": prompt.messages, "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
            }  # fmt: skip
            sent = time.monotonic()
            try:
                events = await stream_events(
                    *connection, post_request("/v1/chat/completions", body, key=key)
                )
            except (RuntimeError, OSError, asyncio.IncompleteReadError):
                errors += 1
                connection = await asyncio.open_connection("127.0.0.1", port)
                continue
            stamps = events.stamps
            ttft.append(stamps[0] - sent)
            (steady if answered else first).append(stamps[0] - sent)
            answered += 1
            if len(stamps) > 1:
                tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
        connection[1].close()

    await asyncio.gather(*(loop() for _ in range(streams)))
    return {
        "requests": len(ttft),
        "errors": errors,
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p99_ms": 1000 * percentile(ttft, 99),
        "tpot_p50_ms": 1000 * percentile(tpot, 50),
        "ttft_first_ms": [round(1000 * t, 1) for t in first],
        "ttft_steady_p50_ms": 1000 * percentile(steady, 50),
        "ttft_steady_p99_ms": 1000 * percentile(steady, 99),
    }


def batch_lines(model: str, prompts: list[dict], tokens: int) -> bytes:
    rows = []
    for i, prompt in enumerate(prompts):
        body = {
            "model": model, "messages": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True,
        }  # fmt: skip
        rows.append({"custom_id": f"line-{i}", "method": "POST",
                     "url": "/v1/chat/completions", "body": body})  # fmt: skip
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def submit(client: httpx.Client, data: bytes) -> str:
    uploaded = client.post(
        "/v1/files", files={"file": ("in.jsonl", io.BytesIO(data))}, data={"purpose": "batch"}
    )
    uploaded.raise_for_status()
    created = client.post(
        "/v1/batches",
        json={"input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions",
              "completion_window": "24h"},
    )  # fmt: skip
    created.raise_for_status()
    return created.json()["id"]


def batch_state(client: httpx.Client, batch_id: str) -> dict:
    return client.get(f"/v1/batches/{batch_id}").json()


def wait_until(client: httpx.Client, batch_id: str, done, *, timeout: float = 3600.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = batch_state(client, batch_id)
        if done(state):
            return state
        time.sleep(0.02)
    raise TimeoutError(f"batch {batch_id}: still {state['status']}")


def cpu_s(pid: int) -> float:
    """A process's CPU time so far (user + system, all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def offline_run(llm, prompt_ids: list[list[int]], tokens: int) -> dict:
    """The offline engine on the same prompts, all at once (its own continuous batching):
    output tokens/s and this process's CPU seconds."""
    from worker import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start, cpu = time.monotonic(), time.process_time()
    outputs = llm.generate(prompt_ids, params)
    elapsed = time.monotonic() - start
    return {"tok_s": sum(len(o.token_ids) for o in outputs) / elapsed, "seconds": elapsed,
            "cpu_s": time.process_time() - cpu}  # fmt: skip


def engine_in_flight(llm, prompt_ids: list[list[int]], tokens: int, in_flight: int) -> dict:
    """The worker's engine in this process running the lines as the worker gets them: in the
    batch band for one tenant, ``in_flight`` at a time, the next added as one finishes."""
    from worker import SamplingParams
    from worker.core.sequence import Band

    engine, params = llm.engine, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    tag, pending, live, produced = uuid.uuid4().hex, deque(enumerate(prompt_ids)), 0, 0
    start = time.monotonic()
    while pending or live:
        while pending and live < in_flight:
            i, ids = pending.popleft()
            engine.add_request(f"{tag}-{i}", ids, params, tenant="bulk", band=Band.BATCH)
            live += 1
        for output in engine.step():
            if output.finished:
                live -= 1
                produced += output.num_tokens
    elapsed = time.monotonic() - start
    return {"tok_s": produced / elapsed, "seconds": elapsed}


def watch_final(store: redis.Redis, key: str, lines: int, *, timeout: float = 3600.0) -> None:
    """Until the batch's stored status is final, read from Redis: every 0.5 s while more than
    `NEAR_END_LINES` of its `lines` are unrecorded, then every 10 ms. Asking the API instead
    costs the gateway about a millisecond of CPU each time, and a 10 ms poll throughout cost
    this process 2.5% of a core (measured): either would be taken from the cores the worker
    computes on (stalling its thread team), which an idle worker would not pay."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if store.hget(key, "status") in (b"completed", b"failed", b"expired", b"cancelled"):
            return
        near_end = store.hlen(f"{key}:lines") >= lines - NEAR_END_LINES
        time.sleep(0.01 if near_end else 0.5)
    raise TimeoutError(f"{key}: not final after {timeout} s")


def batch_alone(
    client: httpx.Client, data: bytes, lines: int, pids: dict[str, int], *, store: redis.Redis,
    prefix: str,
) -> dict:  # fmt: skip
    """A batch of `lines` lines on the idle worker, from upload to `completed`, with the CPU
    seconds each process of the stack spent on it (`pids`: name → pid)."""
    cpu = {name: cpu_s(pid) for name, pid in pids.items()}
    start = time.monotonic()
    batch_id = submit(client, data)
    watch_final(store, tenant_key(prefix, "bulk", f"batch:{batch_id}"), lines)
    elapsed = time.monotonic() - start
    done = batch_state(client, batch_id)
    tokens = done["usage"]["output_tokens"]
    return {"status": done["status"], "seconds": elapsed, "output_tokens": tokens,
            "tok_s": tokens / elapsed,
            "cpu_s": {name: cpu_s(pid) - cpu[name] for name, pid in pids.items()}}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    model = Path(args.model)
    prompts = Prompts(model, seed=59)
    os.environ["SWITCHBOARD_BATCH_LINES_IN_FLIGHT"] = str(args.lines_in_flight)
    report: dict = {"args": vars(args)}
    # One set of prompts per turn, so neither side's prefix cache holds the next turn's.
    turns = [
        [prompts.long(args.prompt_tokens) for _ in range(args.throughput_lines)]
        for _ in range(args.repeats)
    ]
    stack = Stack(
        model=model, gateway_port=free_port(), key_prefix=f"sbbench:{uuid.uuid4().hex[:8]}:",
        worker_nice=args.worker_nice,
    )  # fmt: skip
    stack.start(timeout=args.start_timeout)  # a loaded machine warms the worker up slowly
    try:
        chat_key = stack.create_tenant_key("chat")
        bulk_key = stack.create_tenant_key("bulk")
        bulk = httpx.Client(
            base_url=stack.base_url, headers={"Authorization": f"Bearer {bulk_key}"}, timeout=60
        )
        name = model.name

        def window(seconds: float) -> dict:
            return asyncio.run(chat_window(
                stack.gateway_port, chat_key, name, prompts, streams=args.chat_streams,
                tokens=args.chat_tokens, prompt_tokens=args.prompt_tokens, seconds=seconds,
            ))  # fmt: skip

        window(min(5.0, args.seconds))  # warm the path
        if not args.throughput_only:
            report["idle"] = window(args.seconds)
            print("interactive, idle:", report["idle"])

            # 1. The same chats while a batch runs.
            lines = [prompts.long(args.prompt_tokens).messages for _ in range(args.lines)]
            busy = submit(bulk, batch_lines(name, lines, args.batch_tokens))
            wait_until(bulk, busy, lambda s: s["request_counts"]["completed"] >= 1)
            before = batch_state(bulk, busy)["request_counts"]["completed"]
            report["with_batch"] = window(args.seconds)
            after = batch_state(bulk, busy)["request_counts"]["completed"]
            report["with_batch"]["batch_lines_in_window"] = after - before
            print("interactive, with a batch:", report["with_batch"])
            bulk.post(f"/v1/batches/{busy}/cancel")
            wait_until(bulk, busy, lambda s: s["status"] in ("cancelled", "completed"))

        # 2. A batch alone, and the offline engine on the same prompts, taken in turns (the
        # stack idle while the offline engine runs here), so a load that comes and goes
        # falls on both alike.
        from worker import LLM, SamplingParams

        llm = LLM(model)
        workers_engine = LLM(model)  # its own prefix cache
        warm = prompts.tokenizer.encode_chat(prompts.long(args.prompt_tokens).messages)
        for each in (llm, workers_engine):
            each.generate([warm], SamplingParams(max_tokens=4, temperature=0.0))
        pids = {"gateway": stack.gateway.pid, "worker": stack.workers["worker-0"].pid}
        store = redis.Redis.from_url(str(stack.redis_url))
        runs, offline, in_engine = [], [], []
        for turn in turns:
            ids = [prompts.tokenizer.encode_chat(p.messages) for p in turn]
            offline.append(offline_run(llm, ids, args.batch_tokens))
            in_engine.append(
                engine_in_flight(workers_engine, ids, args.batch_tokens, args.lines_in_flight)
            )
            data = batch_lines(name, [p.messages for p in turn], args.batch_tokens)
            runs.append(batch_alone(
                bulk, data, len(turn), pids, store=store, prefix=stack.key_prefix
            ))  # fmt: skip
            runs[-1]["gateway_cpu_ms_per_line"] = (
                1000 * runs[-1]["cpu_s"]["gateway"] / args.throughput_lines
            )
            print("batch alone:", runs[-1], "offline:", offline[-1], "engine:", in_engine[-1])
        llm.shutdown()
        workers_engine.shutdown()
    finally:
        stack.stop()
    report["batch_alone"] = {"lines": args.throughput_lines, "runs": runs,
                             "tok_s": float(np.median([r["tok_s"] for r in runs]))}  # fmt: skip
    report["offline_runs"] = offline
    report["engine_in_flight_runs"] = in_engine
    report["offline_tok_s"] = float(np.median([o["tok_s"] for o in offline]))
    by_turn = [r["tok_s"] / o["tok_s"] for r, o in zip(runs, offline, strict=True)]
    report["ratios"] = {
        # Each turn's two halves ran close in time; the median of their ratios.
        "batch_over_offline_by_turn": by_turn,
        "batch_over_offline": float(np.median(by_turn)),
        "engine_over_offline": float(np.median(
            [e["tok_s"] / o["tok_s"] for e, o in zip(in_engine, offline, strict=True)]
        )),
        "batch_over_engine": float(np.median(
            [r["tok_s"] / e["tok_s"] for r, e in zip(runs, in_engine, strict=True)]
        )),
    }  # fmt: skip
    report["gateway_cpu_ms_per_line"] = float(
        np.median([r["gateway_cpu_ms_per_line"] for r in runs])
    )
    if not args.throughput_only:
        idle, busy_ = report["idle"], report["with_batch"]
        report["ratios"].update(
            ttft_p50=busy_["ttft_p50_ms"] / idle["ttft_p50_ms"],
            ttft_p99=busy_["ttft_p99_ms"] / idle["ttft_p99_ms"],
            ttft_steady_p99=busy_["ttft_steady_p99_ms"] / idle["ttft_steady_p99_ms"],
            tpot_p50=busy_["tpot_p50_ms"] / idle["tpot_p50_ms"],
        )
    report["targets"] = TARGETS
    print(json.dumps(report["ratios"], indent=2))
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--throughput-lines", type=int, default=128)
    parser.add_argument("--lines-in-flight", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=32)
    parser.add_argument("--chat-tokens", type=int, default=32)
    parser.add_argument("--chat-streams", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--worker-nice", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="batch-alone / offline turns")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument(
        "--throughput-only", action="store_true", help="only part 2: the batch alone"
    )
    parser.add_argument("--quick", action="store_true", help="a short run, to check it runs")
    parser.add_argument("--out", default="bench/results/batch.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.lines, args.throughput_lines, args.seconds, args.repeats = 100, 16, 8.0, 1
    return write_report(run(args), args.out)


if __name__ == "__main__":
    main()
