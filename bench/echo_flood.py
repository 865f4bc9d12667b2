"""A quiet tenant's time to first token while another floods the engine with scored prompts.

Tenant A keeps ``--long-count`` prompts of ``--long`` tokens and ``--short-count`` of ``--short``
tokens in flight (each asking for its prompt's logprobs, 20 alternatives, one new token; fresh
random tokens every time, so no prefix-cache hit); tenant B asks one 16-token question at a time.
Four phases of ``--seconds`` each, in one engine: B alone; A's flood as plain prompts; A's flood
scored, charged as plain prompts (``scored_token_cost`` 1, as before prompt scoring was costed);
A's flood scored, charged at the model's scoring cost (``worker.core.prompt_scoring``). Reports
B's TTFT p50/p90 and A's prompt tokens computed per second in each phase.

Usage: ``python -m bench.echo_flood [--model DIR] [--long 8190 --short 1500 --seconds 60]``.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time

import numpy as np

from bench.report import write_report
from runtime.home import default_model_dir
from worker import LLMEngine, SamplingParams, engine_config
from worker.model.model_config import ModelConfig

QUIET_PROMPT = 16
TOP = 20


def phase(engine: LLMEngine, args, *, flood: bool, scored: bool, cost: float) -> dict:
    engine.scheduler.scored_token_cost = cost
    engine.scheduler.ledger.scored_token_cost = cost
    rng = random.Random(0)
    ids = itertools.count()
    vocab = args.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 1) for _ in range(n)]

    def add_flood(length: int) -> None:
        params = SamplingParams(max_tokens=1, prompt_logprobs=TOP if scored else None)
        request_id = f"a{next(ids)}"
        engine.add_request(request_id, prompt(length), params, tenant="a")
        lengths[request_id] = length

    lengths: dict[str, int] = {}
    if flood:
        for _ in range(args.long_count):
            add_flood(args.long)
        for _ in range(args.short_count):
            add_flood(args.short)
    quiet = SamplingParams(max_tokens=1)
    ttfts, flood_tokens = [], 0
    asked = None
    started = time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        if asked is None:
            engine.add_request(f"b{next(ids)}", prompt(QUIET_PROMPT), quiet, tenant="b")
            asked = time.perf_counter()
        for out in engine.step():
            if not out.finished:
                continue
            if out.request_id.startswith("b"):
                ttfts.append(time.perf_counter() - asked)
                asked = None
            elif flood:
                length = lengths.pop(out.request_id)
                flood_tokens += length
                add_flood(length)
    elapsed = time.perf_counter() - started
    for request_id in list(engine.requests):
        engine.abort(request_id)
    while engine.scheduler.has_work:
        engine.step()
    return {
        "quiet_requests": len(ttfts),
        "ttft_p50_ms": float(np.percentile(ttfts, 50) * 1e3) if ttfts else None,
        "ttft_p90_ms": float(np.percentile(ttfts, 90) * 1e3) if ttfts else None,
        "flood_prompt_tokens_per_s": flood_tokens / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (the default model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--long", type=int, default=8190)
    parser.add_argument("--long-count", type=int, default=2)
    parser.add_argument("--short", type=int, default=1500)
    parser.add_argument("--short-count", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--out", default="bench/results/echo_flood.json")
    args = parser.parse_args()
    model = args.model or str(default_model_dir())
    args.vocab_size = ModelConfig.from_pretrained(model).vocab_size
    engine = LLMEngine(
        model,
        engine_config(dtype=args.dtype, max_model_len=max(args.long, args.short) + 8, warmup=True),
    )
    measured = engine.scheduler.scored_token_cost
    phases = {
        "quiet alone": dict(flood=False, scored=False, cost=measured),
        "plain flood": dict(flood=True, scored=False, cost=measured),
        "scored flood, charged as plain": dict(flood=True, scored=True, cost=1.0),
        f"scored flood, charged at {measured:.2f}": dict(flood=True, scored=True, cost=measured),
    }
    results = {}
    for name, setting in phases.items():
        results[name] = phase(engine, args, **setting)
        print(name, results[name], flush=True)
    write_report({"args": vars(args), "scored_token_cost": measured, **results}, args.out)


if __name__ == "__main__":
    main()
