"""Fair multi-tenant scheduling through the real stack (issue 28).

Each run starts its own stack (Redis, one worker on the default model, the gateway) and
drives it over HTTP with OpenAI streaming chats (``ignore_eos``, so every finished stream
is exactly ``max_tokens`` long).

1. Contention, once per policy (``fair``, ``fcfs``: the worker's ``--scheduling-policy``;
   ``fair-unbounded``: fair with ``--decode-step-budget-ms 0``, steps carrying decodes not
   cut): tenant A keeps N chats in flight (closed loop; prompts of random vocabulary words,
   distinct per request so the prefix cache does not make them free, counted with the
   gateway's own tokenizer); tenant B sends one short question at a time. Reported: B's TTFT
   and time per output token idle (before A starts) and under A's load (B's requests waiting
   for a first token at some time in the window, so one stuck since the warm-up counts), B's
   completed requests, and output tokens/s of A+B over a fixed window after a warm-up
   (prompt tokens/s beside it: a prefill-heavy window generates little).
2. Weighted (``--weighted``): two tenants, both backlogged with A's long prompts, weights
   3:1 set through ``PUT /admin/tenants/{tenant}/scheduling``: each one's share of the
   tokens generated in the window.

Streams in flight when the window closes run to their end; only their tokens inside the
window count. Fair service is the Virtual Token Counter of Sheng et al., "Fairness in
Serving Large Language Models" (OSDI 2024).
Usage: ``python -m bench.fairness [--seconds 60] [--a-streams 48]
[--policies fair,fair-unbounded,fcfs] [--weighted] [--quick]
[--out bench/results/fairness.json]``.
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
from runtime.embedded_redis import free_port
from runtime.stack import Stack, switchboard_command

# The targets on the 2-core machine (issues 28 and 42).
TARGETS = {"ttft_p50_ms": 1000.0, "ttft_p90_ms": 2000.0, "fair_over_fcfs_tok_s": 0.95,
           "weighted_share_points": 5.0, "tpot_load_over_idle": 3.0,
           "bounded_over_unbounded_tok_s": 0.90}  # fmt: skip
# Policies beyond the worker's --scheduling-policy values: (that policy, extra flags). And
# "POLICY@MS": POLICY with --decode-step-budget-ms MS.
POLICIES = {"fair-unbounded": ("fair", ["--decode-step-budget-ms", "0"])}
SERVICE_METRIC = "switchboard_worker_tenant_service_tokens"
WEIGHTS = {"heavy": 3, "light": 1}
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "How many legs does a spider have?",
    "What does a thermometer measure?",
    "Which planet is closest to the sun?",
    "Who wrote Romeo and Juliet?",
]


@dataclass
class Scale:
    a_streams: int  # tenant A's chats in flight
    prompt_tokens: int  # A's prompt length, chat template included
    a_max_tokens: int
    b_max_tokens: int
    warmup: float  # seconds of load before the window opens: about one round of A's chats
    seconds: float  # the measured window
    weighted_streams: int  # per tenant, in the weighted run
    worker_args: str = ""  # before --worker-args
    idle_requests: int = 10


FULL = Scale(48, 1100, 96, 16, warmup=60.0, seconds=60.0, weighted_streams=48)
# Four running sequences at most, so that 8 streams contend for the engine as 48 long ones
# do for the full scale's KV cache and step budget.
QUICK = Scale(8, 300, 96, 16, warmup=5.0, seconds=15.0, weighted_streams=4,
              worker_args="--max-num-seqs 4")  # fmt: skip


@dataclass
class Prompt:
    messages: list[dict[str, str]]
    tokens: int  # as the gateway counts them, chat template included


@dataclass
class Stream:
    """One finished streaming chat: when it was sent, when each content event arrived."""

    sent: float
    stamps: list[float]
    prompt_tokens: int
    tokens: int  # ignore_eos: max_tokens

    def tokens_between(self, start: float, end: float) -> float:
        """Tokens generated in [start, end), spread evenly over the content events (an
        event carries more than one token only where the detokenizer held text back)."""
        inside = bisect.bisect_left(self.stamps, end) - bisect.bisect_left(self.stamps, start)
        return self.tokens * inside / len(self.stamps)


@dataclass
class Tenant:
    name: str
    key: str
    prompt: Callable[[], Prompt]
    max_tokens: int
    streams: list[Stream] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)

    def window(self, start: float, end: float) -> dict[str, float]:
        """Tokens generated in the window, and prompt tokens whose first token came in it."""
        return {
            "tokens": sum(s.tokens_between(start, end) for s in self.streams),
            "prompt_tokens": sum(s.prompt_tokens for s in self.streams
                                 if start <= s.stamps[0] < end),
        }  # fmt: skip


class Prompts:
    """Distinct chat prompts: random whole-word vocabulary tokens, or numbered questions."""

    def __init__(self, model: Path, *, seed: int) -> None:
        self.tokenizer = ChatTokenizer.from_dir(model)
        # "Ġword": a byte-level BPE token that is a space and a whole word, so n words
        # make about n tokens; each prompt is counted exactly anyway.
        vocab = self.tokenizer.tokenizer.get_vocab()
        self.words = sorted(w[1:] for w in vocab if re.fullmatch(r"Ġ[a-z]{3,10}", w))
        self.overhead = self.count("").tokens
        self.rng = random.Random(seed)
        self.asked = 0

    def count(self, text: str) -> Prompt:
        messages = [{"role": "user", "content": text}]
        return Prompt(messages, len(self.tokenizer.encode_chat(messages)))

    def long(self, tokens: int) -> Prompt:
        return self.count(" ".join(self.rng.choices(self.words, k=tokens - self.overhead)))

    def question(self) -> Prompt:
        self.asked += 1
        return self.count(f"(#{self.asked}) {QUESTIONS[self.asked % len(QUESTIONS)]}")


class Client:
    """One tenant's keep-alive connection, reopened after a refused or broken stream."""

    def __init__(self, port: int, model: str, tenant: Tenant) -> None:
        self.port, self.model, self.tenant = port, model, tenant
        self.connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def chat(self) -> None:
        """One chat to its end, recorded as a Stream; a failure is counted, then 0.2 s idle."""
        tenant, prompt = self.tenant, self.tenant.prompt()
        body = {
            "model": self.model, "messages": prompt.messages, "max_tokens": tenant.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
        }  # fmt: skip
        request = post_request("/v1/chat/completions", body, key=tenant.key)
        try:
            if self.connection is None:
                self.connection = await asyncio.open_connection("127.0.0.1", self.port)
            sent = time.monotonic()
            events = await stream_events(*self.connection, request)
        except (RuntimeError, OSError, asyncio.IncompleteReadError) as error:
            tenant.errors[str(error)] += 1  # e.g. "expected a 200 event stream, got 429"
            self.close()
            await asyncio.sleep(0.2)
            return
        tenant.streams.append(Stream(sent, events.stamps, prompt.tokens, tenant.max_tokens))

    def close(self) -> None:
        if self.connection is not None:
            self.connection[1].close()
        self.connection = None


async def closed_loops(
    port: int, model: str, loops: list[tuple[Tenant, int]], *, warmup: float, seconds: float
) -> tuple[float, float]:
    """Each tenant's closed loops (a new chat as soon as one ends) until the window ends,
    then the streams in flight run out. Returns the window (start, end)."""
    start = time.monotonic() + warmup
    end = start + seconds

    async def loop(tenant: Tenant) -> None:
        client = Client(port, model, tenant)
        while time.monotonic() < end:
            await client.chat()
        client.close()

    await asyncio.gather(*(loop(tenant) for tenant, count in loops for _ in range(count)))
    return start, end


def ttft_ms(streams: list[Stream]) -> dict[str, float]:
    ttft = [(s.stamps[0] - s.sent) * 1e3 for s in streams]
    if not ttft:
        return {"n": 0}
    return {"n": len(ttft), "p50": float(np.percentile(ttft, 50)),
            "p90": float(np.percentile(ttft, 90)), "max": max(ttft)}  # fmt: skip


def tpot_ms(streams: list[Stream]) -> dict[str, float]:
    """Time per output token after the first: (last event - first event) / (tokens - 1)."""
    tpot = [(s.stamps[-1] - s.stamps[0]) * 1e3 / (s.tokens - 1) for s in streams if s.tokens > 1]
    if not tpot:
        return {"n": 0}
    return {"n": len(tpot), "p50": float(np.percentile(tpot, 50)),
            "p90": float(np.percentile(tpot, 90)), "mean": float(np.mean(tpot))}  # fmt: skip


def make_tenant(stack: Stack, name: str, prompt: Callable[[], Prompt], max_tokens: int) -> Tenant:
    """A tenant with a key and no concurrency cap (a gateway default would throttle A)."""
    key = stack.create_tenant_key(name)
    stack.admin("PUT", f"/tenants/{name}/quotas", json={"max_concurrent_requests": 10_000})
    return Tenant(name, key, prompt, max_tokens)


async def computed_tokens(stack: Stack) -> float:
    """Tokens the workers have computed (prompt tokens and decodes of every tenant; cache
    hits not counted), from their /metrics."""
    total = 0.0
    async with httpx.AsyncClient() as client:
        for port in stack.metrics_ports.values():
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
            total += sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(SERVICE_METRIC + "_total{")
            )
    return total


async def computed_between(stack: Stack, start: float, end: float) -> float:
    """Tokens computed per second in [start, end) (monotonic times), read at both ends."""
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    before = await computed_tokens(stack)
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    return (await computed_tokens(stack) - before) / (end - start)


async def contention(stack: Stack, model: str, prompts: Prompts, scale: Scale) -> dict:
    a = make_tenant(stack, "a", lambda: prompts.long(scale.prompt_tokens), scale.a_max_tokens)
    b = make_tenant(stack, "b", prompts.question, scale.b_max_tokens)
    idle = Tenant("b", b.key, prompts.question, scale.b_max_tokens)
    client = Client(stack.gateway_port, model, idle)
    for _ in range(scale.idle_requests + 1):  # the first (discarded) pays one-off costs
        await client.chat()
    client.close()
    opened = time.monotonic()
    computed = asyncio.create_task(
        computed_between(stack, opened + scale.warmup, opened + scale.warmup + scale.seconds)
    )
    start, end = await closed_loops(
        stack.gateway_port, model, [(a, scale.a_streams), (b, 1)],
        warmup=scale.warmup, seconds=scale.seconds,
    )  # fmt: skip
    drain = time.monotonic() - end
    window = {"a": a.window(start, end), "b": b.window(start, end)}
    loaded = [s for s in b.streams if s.sent < end and s.stamps[0] >= start]
    return {
        "b_ttft_idle_ms": ttft_ms(idle.streams[1:]),
        "b_ttft_load_ms": ttft_ms(loaded),
        "b_tpot_idle_ms": tpot_ms(idle.streams[1:]),
        "b_tpot_load_ms": tpot_ms(loaded),
        "b_completed": sum(start <= s.stamps[-1] < end for s in b.streams),
        "a_completed": sum(start <= s.stamps[-1] < end for s in a.streams),
        "window": window,
        "output_tok_per_s": sum(w["tokens"] for w in window.values()) / (end - start),
        "prompt_tok_per_s": sum(w["prompt_tokens"] for w in window.values()) / (end - start),
        "computed_tok_per_s": await computed,
        "drain_s": drain,
        "a_prompt_tokens_mean": float(np.mean([s.prompt_tokens for s in a.streams])),
        "b_prompt_tokens_mean": float(np.mean([s.prompt_tokens for s in b.streams])),
        "errors": {"a": dict(a.errors), "b": dict(b.errors), "b_idle": dict(idle.errors)},
    }


async def weighted(stack: Stack, model: str, prompts: Prompts, scale: Scale) -> dict:
    tenants, applied = [], True
    for name, weight in WEIGHTS.items():
        tenant = make_tenant(
            stack, name, lambda: prompts.long(scale.prompt_tokens), scale.a_max_tokens
        )
        tenants.append(tenant)
        try:
            stack.admin("PUT", f"/tenants/{name}/scheduling", json={"weight": weight})
        except httpx.HTTPStatusError as error:
            if error.response.status_code not in (404, 405):
                raise
            applied = False  # this gateway has no per-tenant weights
    start, end = await closed_loops(
        stack.gateway_port, model, [(t, scale.weighted_streams) for t in tenants],
        warmup=scale.warmup, seconds=scale.seconds,
    )  # fmt: skip
    window = {t.name: t.window(start, end) for t in tenants}
    total = sum(w["tokens"] for w in window.values()) or 1.0
    return {
        "weights": WEIGHTS,
        "weights_applied": applied,
        "window": window,
        "share": {name: w["tokens"] / total for name, w in window.items()},
        "target_share": {name: w / sum(WEIGHTS.values()) for name, w in WEIGHTS.items()},
        "output_tok_per_s": total / (end - start),
        "errors": {t.name: dict(t.errors) for t in tenants},
    }


def policy_args(policy: str) -> list[str]:
    """The worker flags for ``policy``; a worker without --scheduling-policy is FCFS and
    nothing else."""
    if "@" in policy:
        policy, budget_ms = policy.split("@")
        extra = ["--decode-step-budget-ms", budget_ms]
    else:
        policy, extra = POLICIES.get(policy, (policy, []))
    command = [*switchboard_command(), "worker", "--help"]
    helps = subprocess.run(command, capture_output=True, text=True).stdout
    if any(flag.startswith("--") and flag not in helps for flag in extra):
        raise SystemExit(f"this worker has no {extra[0]}, so no such run")
    if "--scheduling-policy" in helps:
        return ["--scheduling-policy", policy, *extra]
    if policy == "fcfs":
        return extra
    raise SystemExit(f"this worker has no --scheduling-policy, so no {policy!r} run")


def with_stack(policy: str, scenario, scale: Scale, args: argparse.Namespace) -> dict:
    """Run one scenario on a fresh stack whose worker schedules by ``policy``."""
    from worker.model.default_model import resolve_model_path

    model_path = resolve_model_path(None)
    extra = shlex.split(scale.worker_args) + shlex.split(args.worker_args)
    worker_args = [*policy_args(policy), *extra]
    prompts = Prompts(model_path, seed=7)  # the same prompts for every policy
    try:
        with Stack(
            model=model_path, gateway_port=free_port(), worker_args=worker_args,
            key_prefix=f"sbbench:{uuid.uuid4().hex[:8]}:",  # a fresh namespace in Redis
            worker_nice=args.worker_nice,
        ) as stack:  # fmt: skip
            result = asyncio.run(scenario(stack, model_path.name, prompts, scale))
    finally:
        prompts.tokenizer.close()
    return {"policy": policy, "worker_args": worker_args, **result}


def verdicts(report: dict) -> dict[str, bool]:
    out = {}
    for policy, result in report["policies"].items():
        load = result["b_ttft_load_ms"]
        out[f"{policy}: B TTFT p50 <= 1 s"] = load.get("p50", 1e12) <= TARGETS["ttft_p50_ms"]
        out[f"{policy}: B TTFT p90 <= 2 s"] = load.get("p90", 1e12) <= TARGETS["ttft_p90_ms"]
    if "fair_over_fcfs_tok_s" in report:
        ok = report["fair_over_fcfs_tok_s"] >= TARGETS["fair_over_fcfs_tok_s"]
        out["fair output tok/s within 5% of fcfs"] = ok
    fair = report["policies"].get("fair", {})
    if fair.get("b_tpot_idle_ms", {}).get("n") and fair.get("b_tpot_load_ms", {}).get("n"):
        ratio = fair["b_tpot_load_ms"]["p50"] / fair["b_tpot_idle_ms"]["p50"]
        out["fair: B TPOT under load <= 3x idle"] = ratio <= TARGETS["tpot_load_over_idle"]
    if "bounded_over_unbounded_tok_s" in report:
        ok = report["bounded_over_unbounded_tok_s"] >= TARGETS["bounded_over_unbounded_tok_s"]
        out["fair computed tok/s within 10% of fair-unbounded"] = ok
    if "weighted" in report:
        w = report["weighted"]
        off = max(abs(w["share"][t] - w["target_share"][t]) * 100 for t in w["share"])
        out["weighted shares within 5 points of 75/25"] = off <= TARGETS["weighted_share_points"]
    return out


def print_table(report: dict) -> None:
    if report["policies"]:
        print_policies(report["policies"])
    if "fair_over_fcfs_tok_s" in report:
        print(f"fair / fcfs output tok/s: {report['fair_over_fcfs_tok_s']:.3f}")
    if "bounded_over_unbounded_tok_s" in report:
        ratio = report["bounded_over_unbounded_tok_s"]
        print(f"fair / fair-unbounded computed tok/s: {ratio:.3f}")
    if "weighted" in report:
        w = report["weighted"]
        shares = ", ".join(f"{t} {s * 100:.1f}%" for t, s in w["share"].items())
        note = "" if w["weights_applied"] else " (weights NOT applied: no scheduling route)"
        print(f"weighted ({w['policy']}, 3:1): {shares} of tokens; target 75/25 +-5{note}")
    for name, ok in report["verdicts"].items():
        print(f"  {'met   ' if ok else 'MISSED'} {name}")


def print_policies(policies: dict) -> None:
    print(f"{'policy':15}{'B TTFT idle p50':>16}{'load p50':>10}{'p90':>9}{'max':>9}"
          f"{'B TPOT idle':>12}{'load p50':>10}{'B done':>8}{'out tok/s':>10}"
          f"{'prompt tok/s':>13}{'computed tok/s':>15}")  # fmt: skip
    for policy, r in policies.items():
        idle, load = r["b_ttft_idle_ms"], r["b_ttft_load_ms"]
        tpot_idle, tpot_load = r["b_tpot_idle_ms"], r["b_tpot_load_ms"]
        ms = [f"{x:.0f} ms" if x is not None else "-" for x in
              (idle.get("p50"), load.get("p50"), load.get("p90"), load.get("max"),
               tpot_idle.get("p50"), tpot_load.get("p50"))]  # fmt: skip
        print(f"{policy:15}{ms[0]:>16}{ms[1]:>10}{ms[2]:>9}{ms[3]:>9}{ms[4]:>12}{ms[5]:>10}"
              f"{r['b_completed']:>8}{r['output_tok_per_s']:>10.1f}"
              f"{r['prompt_tok_per_s']:>13.0f}{r['computed_tok_per_s']:>15.1f}")  # fmt: skip
    print(
        "targets: B TTFT p50 <= 1000 ms, p90 <= 2000 ms under load; fair tok/s >= 95% of "
        "fcfs; fair: B TPOT under load <= 3x idle, tok/s >= 90% of fair-unbounded"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="smoke scale: 8 streams, 15 s, 4 sequences"
    )
    parser.add_argument("--seconds", type=float, help="measured window (60; quick 15)")
    parser.add_argument("--warmup", type=float, help="load before the window (60; quick 5)")
    parser.add_argument("--a-streams", type=int, help="tenant A's chats in flight (48; quick 8)")
    parser.add_argument("--prompt-tokens", type=int, help="A's prompt length (1100; quick 300)")
    parser.add_argument(
        "--policies", default="fair,fair-unbounded,fcfs", help="comma-separated; '' for none"
    )
    parser.add_argument("--weighted", action="store_true", help="also the 3:1 weighted run")
    parser.add_argument("--weighted-policy", default="fair")
    parser.add_argument("--weighted-streams", type=int, help="per tenant (48; quick 4)")
    parser.add_argument("--worker-args", default="", help="extra worker flags, one string")
    parser.add_argument("--worker-nice", type=int, default=0)
    parser.add_argument("--out", default="bench/results/fairness.json")
    args = parser.parse_args(argv)
    overrides = {
        "seconds": args.seconds, "warmup": args.warmup, "a_streams": args.a_streams,
        "prompt_tokens": args.prompt_tokens, "weighted_streams": args.weighted_streams,
    }  # fmt: skip
    scale = Scale(**{**asdict(QUICK if args.quick else FULL),
                     **{k: v for k, v in overrides.items() if v is not None}})  # fmt: skip
    report: dict = {"scale": asdict(scale), "targets": TARGETS, "policies": {}}
    for policy in filter(None, args.policies.split(",")):
        result = report["policies"][policy] = with_stack(policy, contention, scale, args)
        print(f"{policy}: {result['output_tok_per_s']:.1f} output tok/s, "
              f"{result['computed_tok_per_s']:.1f} computed, B TTFT under load "
              f"{result['b_ttft_load_ms']}", flush=True)  # fmt: skip
    if {"fair", "fcfs"} <= report["policies"].keys():
        fair, fcfs = (report["policies"][p]["output_tok_per_s"] for p in ("fair", "fcfs"))
        report["fair_over_fcfs_tok_s"] = fair / fcfs
    if {"fair", "fair-unbounded"} <= report["policies"].keys():
        # Tokens the worker computed: what bounding steps could cost. Output tokens alone swing
        # with where the window falls in the flood's prefill and decode phases.
        bounded, unbounded = (
            report["policies"][p]["computed_tok_per_s"] for p in ("fair", "fair-unbounded")
        )
        report["bounded_over_unbounded_tok_s"] = bounded / unbounded
    if args.weighted:
        report["weighted"] = with_stack(args.weighted_policy, weighted, scale, args)
    report["verdicts"] = verdicts(report)
    print_table(report)
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
