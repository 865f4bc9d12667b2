"""Fair multi-tenant scheduling through the real stack (issue 28).

Each run starts its own stack (Redis, one worker on the default model, the gateway) and
drives it over HTTP with OpenAI streaming chats (``ignore_eos``, so every finished stream
is exactly ``max_tokens`` long).

1. Contention, once per ``--scheduling-policy``: tenant A keeps N chats in flight (closed
   loop, prompts of random vocabulary words, distinct per request so the prefix cache
   does not make them free; counted with the gateway's own tokenizer); tenant B sends one
   short question at a time. Reported: B's TTFT idle (before A starts) and under A's load
   (requests sent in the window), B's completed requests, and the output tokens/s of A+B
   over a fixed window after a warm-up.
2. Weighted (``--weighted``): two tenants, both backlogged with long prompts, weights 3:1
   set through ``PUT /admin/tenants/{tenant}/scheduling``: each tenant's share of the
   tokens generated in the window.

The fairness scheme is the Virtual Token Counter of Sheng et al., "Fairness in Serving
Large Language Models" (OSDI 2024).
Usage: ``python -m bench.fairness [--seconds 60] [--a-streams 48] [--policies fair,fcfs]
[--weighted] [--quick] [--out bench/results/fairness.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import random
import re
import shlex
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench.http_load import post_request, stream_events
from bench.report import write_report
from gateway.tokenizer import ChatTokenizer
from switchboard.embedded_redis import free_port
from switchboard.stack import Stack, switchboard_command

# Issue 28's targets on the 2-core machine.
TARGET_TTFT_P50_MS = 1000.0
TARGET_TTFT_P90_MS = 2000.0
TARGET_THROUGHPUT_RATIO = 0.95  # fair's output tok/s over fcfs's, at least
TARGET_SHARE_POINTS = 5.0  # weighted: each tenant within this many points of its weight share
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "How many legs does a spider have?",
    "What does a thermometer measure?",
    "Which planet is closest to the sun?",
    "What is the boiling point of water?",
    "Who wrote Romeo and Juliet?",
    "What gas do plants take in?",
]
Messages = list[dict[str, str]]


@dataclass
class Scale:
    a_streams: int  # tenant A's chats in flight
    prompt_tokens: int  # A's prompt length, chat template included
    a_max_tokens: int
    b_max_tokens: int
    warmup: float  # seconds of load before the window opens
    seconds: float  # the measured window
    weighted_streams: int  # per tenant, in the weighted run
    idle_requests: int = 10


FULL = Scale(48, 1100, 96, 16, warmup=30.0, seconds=60.0, weighted_streams=24)
QUICK = Scale(8, 300, 96, 16, warmup=5.0, seconds=15.0, weighted_streams=4)


@dataclass
class Stream:
    """One finished streaming chat: when it was sent, when each content event arrived."""

    tenant: str
    sent: float
    stamps: list[float]
    tokens: int  # ignore_eos: max_tokens

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.sent

    def tokens_between(self, start: float, end: float) -> float:
        """Tokens generated in [start, end), spread evenly over the content events (an
        event carries more than one token only where the detokenizer held text back)."""
        inside = bisect.bisect_left(self.stamps, end) - bisect.bisect_left(self.stamps, start)
        return self.tokens * inside / len(self.stamps)


@dataclass
class Tenant:
    name: str
    key: str
    messages: Callable[[], Messages]
    max_tokens: int
    streams: list[Stream] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)


class Prompts:
    """Chat prompts of a given token length, from random whole-word vocabulary tokens."""

    def __init__(self, model: Path, *, seed: int) -> None:
        self.tokenizer = ChatTokenizer.from_dir(model)
        vocab = self.tokenizer.tokenizer.get_vocab()
        # "Ġword": a byte-level BPE token that is a space and a whole word, so n words
        # make about n tokens; each prompt is counted exactly anyway.
        self.words = sorted(w[1:] for w in vocab if re.fullmatch(r"Ġ[a-z]{3,10}", w))
        self.overhead = len(self.tokenizer.encode_chat([{"role": "user", "content": ""}]))
        self.rng = random.Random(seed)
        self.counts: dict[str, list[int]] = {}
        self.asked = 0

    def count(self, kind: str, messages: Messages) -> Messages:
        self.counts.setdefault(kind, []).append(len(self.tokenizer.encode_chat(messages)))
        return messages

    def long(self, tokens: int) -> Messages:
        text = " ".join(self.rng.choices(self.words, k=max(1, tokens - self.overhead)))
        return self.count("long", [{"role": "user", "content": text}])

    def question(self) -> Messages:
        self.asked += 1
        text = f"(#{self.asked}) {QUESTIONS[self.asked % len(QUESTIONS)]}"
        return self.count("question", [{"role": "user", "content": text}])

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            kind: {"n": len(c), "min": min(c), "mean": float(np.mean(c)), "max": max(c)}
            for kind, c in self.counts.items()
        }


class Client:
    """One tenant's keep-alive connection, reopened after a refused or broken stream."""

    def __init__(self, port: int, model: str, tenant: Tenant) -> None:
        self.port, self.model, self.tenant = port, model, tenant
        self.connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def chat(self) -> None:
        """One chat to its end, recorded as a Stream; a failure is counted, then 0.2 s idle."""
        tenant = self.tenant
        body = {
            "model": self.model, "messages": tenant.messages(), "max_tokens": tenant.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
        }  # fmt: skip
        request = post_request("/v1/chat/completions", body, key=tenant.key)
        try:
            self.connection = self.connection or await asyncio.open_connection(
                "127.0.0.1", self.port
            )
            sent = time.monotonic()
            events = await stream_events(*self.connection, request)
        except (RuntimeError, OSError, asyncio.IncompleteReadError) as error:
            tenant.errors[str(error)] += 1
            self.close()
            await asyncio.sleep(0.2)
            return
        tenant.streams.append(Stream(tenant.name, sent, events.stamps, tenant.max_tokens))

    def close(self) -> None:
        if self.connection is not None:
            self.connection[1].close()
        self.connection = None


async def chat_loop(port: int, model: str, tenant: Tenant, *, deadline: float) -> None:
    """Closed loop: a new chat as soon as the last one ends, until ``deadline``."""
    client = Client(port, model, tenant)
    while time.monotonic() < deadline:
        await client.chat()
    client.close()


async def run_load(
    port: int, model: str, loops: list[tuple[Tenant, int]], *, warmup: float, seconds: float
) -> tuple[float, float]:
    """Each tenant's closed loops for ``warmup + seconds``; streams in flight then run to
    their end (their tokens inside the window count). Returns the window (start, end)."""
    start = time.monotonic() + warmup
    end = start + seconds
    tasks = [
        chat_loop(port, model, tenant, deadline=end)
        for tenant, count in loops
        for _ in range(count)
    ]
    await asyncio.gather(*tasks)
    return start, end


def ttft_ms(streams: list[Stream]) -> dict[str, float]:
    if not streams:
        return {"n": 0}
    ttft = [s.ttft * 1e3 for s in streams]
    return {
        "n": len(ttft),
        "p50": float(np.percentile(ttft, 50)),
        "p90": float(np.percentile(ttft, 90)),
        "max": float(np.max(ttft)),
    }


def window_tokens(tenant: Tenant, start: float, end: float) -> float:
    return sum(s.tokens_between(start, end) for s in tenant.streams)


def make_tenant(
    stack: Stack, name: str, messages: Callable[[], Messages], max_tokens: int
) -> Tenant:
    """A tenant with a key and no concurrency cap (a gateway default would throttle A)."""
    key = stack.create_tenant_key(name)
    stack.admin("PUT", f"/tenants/{name}/quotas", json={"max_concurrent_requests": 10_000})
    return Tenant(name, key, messages, max_tokens)


async def contention(stack: Stack, model: str, prompts: Prompts, scale: Scale) -> dict:
    a = make_tenant(stack, "a", lambda: prompts.long(scale.prompt_tokens), scale.a_max_tokens)
    b = make_tenant(stack, "b", prompts.question, scale.b_max_tokens)
    port = stack.gateway_port
    idle = Tenant("b-idle", b.key, prompts.question, scale.b_max_tokens)
    client = Client(port, model, idle)
    # One chat first (discarded): the first request of a process pays one-off costs.
    for _ in range(scale.idle_requests + 1):
        await client.chat()
    client.close()
    loaded = await run_load(
        port, model, [(a, scale.a_streams), (b, 1)], warmup=scale.warmup, seconds=scale.seconds
    )
    start, end = loaded
    a_tokens, b_tokens = window_tokens(a, start, end), window_tokens(b, start, end)
    return {
        "b_ttft_idle_ms": ttft_ms(idle.streams[1:]),
        "b_ttft_load_ms": ttft_ms([s for s in b.streams if start <= s.sent < end]),
        "b_completed": sum(start <= s.stamps[-1] < end for s in b.streams),
        "a_completed": sum(start <= s.stamps[-1] < end for s in a.streams),
        "window_tokens": {"a": a_tokens, "b": b_tokens},
        "output_tok_per_s": (a_tokens + b_tokens) / (end - start),
        "drain_s": time.monotonic() - end,
        "errors": {"a": dict(a.errors), "b": dict(b.errors), "b_idle": dict(idle.errors)},
    }


async def weighted(stack: Stack, model: str, prompts: Prompts, scale: Scale) -> dict:
    weights = {"heavy": 3, "light": 1}
    tenants, applied = [], True

    def long() -> Messages:
        return prompts.long(scale.prompt_tokens)

    for name, weight in weights.items():
        tenants.append(make_tenant(stack, name, long, scale.a_max_tokens))
        try:
            stack.admin("PUT", f"/tenants/{name}/scheduling", json={"weight": weight})
        except httpx.HTTPStatusError as error:
            if error.response.status_code not in (404, 405):
                raise
            applied = False  # the gateway has no per-tenant weights yet
    loops = [(t, scale.weighted_streams) for t in tenants]
    start, end = await run_load(
        stack.gateway_port, model, loops, warmup=scale.warmup, seconds=scale.seconds
    )
    tokens = {t.name: window_tokens(t, start, end) for t in tenants}
    total = sum(tokens.values()) or 1.0
    return {
        "weights": weights,
        "weights_applied": applied,
        "window_tokens": tokens,
        "share": {name: n / total for name, n in tokens.items()},
        "target_share": {name: w / sum(weights.values()) for name, w in weights.items()},
        "output_tok_per_s": sum(tokens.values()) / (end - start),
        "errors": {t.name: dict(t.errors) for t in tenants},
    }


def policy_args(policy: str) -> list[str]:
    """The worker flag for ``policy``; a worker without the flag is FCFS and nothing else."""
    help_text = subprocess.run(
        [*switchboard_command(), "worker", "--help"], capture_output=True, text=True, check=True
    ).stdout
    if "--scheduling-policy" in help_text:
        return ["--scheduling-policy", policy]
    if policy == "fcfs":
        return []
    raise SystemExit(f"this worker has no --scheduling-policy, so no {policy!r} run")


def with_stack(policy: str, args: argparse.Namespace, scenario, scale: Scale) -> dict:
    """Run one scenario on a fresh stack whose worker schedules by ``policy``."""
    from worker.default_model import resolve_model_path

    model_path = resolve_model_path(None)
    worker_args = [*policy_args(policy), *shlex.split(args.worker_args)]
    prefix = f"sbbench:{uuid.uuid4().hex[:8]}:"  # a fresh namespace in a shared Redis
    prompts = Prompts(model_path, seed=7)  # the same prompts for every policy
    try:
        with Stack(
            model=model_path, gateway_port=free_port(), key_prefix=prefix,
            worker_args=worker_args, worker_nice=args.worker_nice,
        ) as stack:  # fmt: skip
            result = asyncio.run(scenario(stack, model_path.name, prompts, scale))
    finally:
        prompts.tokenizer.close()
    return {"policy": policy, "worker_args": worker_args, **result,
            "prompt_tokens": prompts.summary()}  # fmt: skip


def verdicts(report: dict) -> dict[str, bool]:
    out = {}
    for policy, result in report["policies"].items():
        load = result["b_ttft_load_ms"]
        out[f"{policy}: B TTFT p50 <= 1 s"] = load.get("p50", float("inf")) <= TARGET_TTFT_P50_MS
        out[f"{policy}: B TTFT p90 <= 2 s"] = load.get("p90", float("inf")) <= TARGET_TTFT_P90_MS
    if "fair_vs_fcfs_throughput" in report:
        ok = report["fair_vs_fcfs_throughput"] >= TARGET_THROUGHPUT_RATIO
        out["fair throughput within 5% of fcfs"] = ok
    if "weighted" in report:
        w = report["weighted"]
        off = max(abs(w["share"][t] - w["target_share"][t]) * 100 for t in w["share"])
        out["weighted shares within 5 points of 3:1"] = off <= TARGET_SHARE_POINTS
    return out


def print_table(report: dict) -> None:
    print(f"{'policy':8} {'B TTFT idle p50':>16} {'load p50':>9} {'p90':>8} {'max':>8}"
          f" {'B done':>7} {'tok/s':>7}")  # fmt: skip
    for policy, r in report["policies"].items():
        idle, load = r["b_ttft_idle_ms"], r["b_ttft_load_ms"]
        cells = [idle.get("p50"), load.get("p50"), load.get("p90"), load.get("max")]
        ms = [f"{c:.0f} ms" if c is not None else "-" for c in cells]
        print(f"{policy:8} {ms[0]:>16} {ms[1]:>9} {ms[2]:>8} {ms[3]:>8}"
              f" {r['b_completed']:>7} {r['output_tok_per_s']:>7.1f}")  # fmt: skip
    print("targets: B TTFT p50 <= 1000 ms, p90 <= 2000 ms under load; fair tok/s >= 95% of fcfs")
    if "fair_vs_fcfs_throughput" in report:
        print(f"fair / fcfs throughput: {report['fair_vs_fcfs_throughput']:.3f}")
    if "weighted" in report:
        w = report["weighted"]
        shares = ", ".join(f"{t} {s * 100:.1f}%" for t, s in w["share"].items())
        note = "" if w["weights_applied"] else " (weights NOT applied: no scheduling route)"
        print(f"weighted ({w['policy']}, 3:1): {shares} of tokens; target 75/25 +-5{note}")
    for name, ok in report["verdicts"].items():
        print(f"  {'met   ' if ok else 'MISSED'} {name}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke scale: 8 streams, 15 s")
    parser.add_argument("--seconds", type=float, help="measured window (60; quick 15)")
    parser.add_argument("--warmup", type=float, help="load before the window (30; quick 5)")
    parser.add_argument("--a-streams", type=int, help="tenant A's chats in flight (48; quick 8)")
    parser.add_argument("--prompt-tokens", type=int, help="A's prompt length (1100; quick 300)")
    parser.add_argument("--policies", default="fair,fcfs", help="comma-separated; '' for none")
    parser.add_argument("--weighted", action="store_true", help="also the 3:1 weighted run")
    parser.add_argument("--weighted-policy", default="fair")
    parser.add_argument("--weighted-streams", type=int, help="per tenant (24; quick 4)")
    parser.add_argument("--worker-args", default="", help="extra worker flags, one string")
    parser.add_argument("--worker-nice", type=int, default=0)
    parser.add_argument("--out", default="bench/results/fairness.json")
    args = parser.parse_args(argv)
    scale = QUICK if args.quick else FULL
    overrides = {
        "seconds": args.seconds, "warmup": args.warmup, "a_streams": args.a_streams,
        "prompt_tokens": args.prompt_tokens, "weighted_streams": args.weighted_streams,
    }  # fmt: skip
    scale = Scale(**{**asdict(scale), **{k: v for k, v in overrides.items() if v is not None}})
    report: dict = {"scale": asdict(scale), "policies": {}}
    for policy in filter(None, args.policies.split(",")):
        report["policies"][policy] = with_stack(policy, args, contention, scale)
        done = report["policies"][policy]
        print(f"{policy}: {done['output_tok_per_s']:.1f} tok/s, B TTFT under load "
              f"{done['b_ttft_load_ms']}", flush=True)  # fmt: skip
    if {"fair", "fcfs"} <= report["policies"].keys():
        fair, fcfs = (report["policies"][p]["output_tok_per_s"] for p in ("fair", "fcfs"))
        report["fair_vs_fcfs_throughput"] = fair / fcfs
    if args.weighted:
        report["weighted"] = with_stack(args.weighted_policy, args, weighted, scale)
    report["verdicts"] = verdicts(report)
    print_table(report)
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
