"""Prefix caching on vs off, on one engine in one process (the cache is toggled and reset).

chat: ``--sessions`` chats x ``--turns`` turns. Every prompt is the same ``--system-tokens``
system prompt, the session's history (its earlier messages and the model's own answers)
and a new user message (seeded, 20-60 tokens); answers are ``--answer-tokens`` long
(greedy, ignore_eos). Sessions run at once; a session's next turn is queued a seeded
think time (exponential, mean ``--think-time-s``; 0: at once) after its answer ends, and its
TTFT is measured from that moment.
document: ``--doc-requests`` requests sharing one ``--doc-tokens`` document, each with its
own question (seeded, 10-40 tokens) and ``--doc-output-tokens`` output tokens, all at once.
Each workload runs with the cache off, then on (reset first), back to back.
Usage: ``python -m bench.prefix [--workload chat|document|all] [--out results.json]``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from bench.report import write_report
from bench.workloads import random_tokens


@dataclass
class RunResult:
    caching: bool
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    total_tok_per_s: float  # (prompt + output) tokens per second
    requests_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    # Turn (1-based) -> TTFT p50 for chat; empty for the document workload.
    ttft_p50_by_turn_s: dict[int, float] = field(default_factory=dict)
    ttft_p50_later_turns_s: float | None = None
    cached_prompt_tokens: int = 0
    hit_rate: float = 0.0  # of the tokens looked up at admission
    cached_blocks: int = 0
    evictions: int = 0
    outputs: list[list[int]] = field(default_factory=list, repr=False)


def chat_turns(args, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt, and each session's user messages per turn."""
    rng = np.random.default_rng(0)
    system = random_tokens(rng, args.system_tokens, vocab)
    users = [
        [random_tokens(rng, int(rng.integers(20, 61)), vocab) for _ in range(args.turns)]
        for _ in range(args.sessions)
    ]
    return system, users


def run_chat(engine, args) -> RunResult:
    from worker import SamplingParams

    system, users = chat_turns(args, engine.config.vocab_size)
    rng = np.random.default_rng(2)
    # Seconds each user takes before the next message (exponential, seeded: the same in
    # both runs); 0 makes the loop closed, and the sessions move in lockstep.
    think = rng.exponential(args.think_time_s, (len(users), args.turns)) * (args.think_time_s > 0)
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    history = [list(system) for _ in users]
    turn_of: dict[str, tuple[int, int]] = {}
    due: list[tuple[float, int, int]] = []  # heap of (time, session, turn) not sent yet

    def send(session: int, turn: int) -> None:
        history[session] += users[session][turn]
        request_id = f"chat-{session}-{turn}"
        turn_of[request_id] = (session, turn)
        engine.add_request(request_id, list(history[session]), params, tenant="bench")

    done = []
    start = time.monotonic()
    for session in range(len(users)):
        send(session, 0)
    while engine.has_unfinished_requests or due:
        while due and due[0][0] <= time.monotonic():
            _, session, turn = heapq.heappop(due)
            send(session, turn)
        if not engine.has_unfinished_requests:
            time.sleep(max(0.0, due[0][0] - time.monotonic()))
            continue
        for out in engine.step():
            if not out.finished:
                continue
            session, turn = turn_of[out.request_id]
            done.append((turn, out))
            history[session] += out.token_ids
            if turn + 1 < args.turns:
                heapq.heappush(due, (time.monotonic() + think[session, turn], session, turn + 1))
    result = summarize(engine, done, time.monotonic() - start)
    by_turn = {t + 1: p50([o.metrics.ttft for tt, o in done if tt == t]) for t in range(args.turns)}
    result.ttft_p50_by_turn_s = by_turn
    result.ttft_p50_later_turns_s = p50([o.metrics.ttft for t, o in done if t > 0])
    return result


def run_document(engine, args) -> RunResult:
    from worker import SamplingParams

    rng = np.random.default_rng(1)
    vocab = engine.config.vocab_size
    document = random_tokens(rng, args.doc_tokens, vocab)
    questions = [
        random_tokens(rng, int(rng.integers(10, 41)), vocab) for _ in range(args.doc_requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.doc_output_tokens, ignore_eos=True)
    start = time.monotonic()
    for i, question in enumerate(questions):
        engine.add_request(f"doc-{i}", document + question, params, tenant="bench")
    done = []
    while engine.has_unfinished_requests:
        done.extend((0, out) for out in engine.step() if out.finished)
    return summarize(engine, done, time.monotonic() - start)


def summarize(engine, done: list, elapsed: float) -> RunResult:
    outs = [out for _, out in sorted(done, key=lambda d: d[1].request_id)]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(o.token_ids) for o in outs)
    ttft = [o.metrics.ttft for o in outs]
    stats = engine.prefix_cache_stats
    return RunResult(
        caching=engine.block_manager.enable_caching,
        num_requests=len(outs),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        elapsed_s=elapsed,
        total_tok_per_s=(prompt_tokens + output_tokens) / elapsed,
        requests_per_s=len(outs) / elapsed,
        ttft_p50_s=p50(ttft),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        cached_prompt_tokens=sum(o.num_cached_tokens for o in outs),
        hit_rate=stats.hit_rate,
        cached_blocks=stats.cached_blocks,
        evictions=stats.evictions,
        outputs=[o.token_ids for o in outs],
    )


def p50(values: list[float]) -> float:
    return float(np.percentile(values, 50))


def measure(engine, run, args, *, caching: bool) -> RunResult:
    """One run with the cache on or off, from an empty cache and fresh counters."""
    from worker.core.prefix_cache import PrefixCacheStats

    engine.reset_prefix_cache()
    engine.block_manager.enable_caching = caching
    engine.block_manager.stats = PrefixCacheStats()
    result = run(engine, args)
    line = {k: v for k, v in asdict(result).items() if k != "outputs"}
    print(json.dumps(line, indent=1), flush=True)
    return result


def compare(off: RunResult, on: RunResult) -> dict:
    same = sum(a == b for a, b in zip(off.outputs, on.outputs, strict=True))
    entry = {
        "off": {k: v for k, v in asdict(off).items() if k != "outputs"},
        "on": {k: v for k, v in asdict(on).items() if k != "outputs"},
        "throughput_ratio": on.total_tok_per_s / off.total_tok_per_s,
        "ttft_p50_reduction": 1 - on.ttft_p50_s / off.ttft_p50_s,
        "same_tokens": f"{same}/{len(on.outputs)}",
    }
    if on.ttft_p50_later_turns_s is not None and off.ttft_p50_later_turns_s:
        entry["ttft_p50_later_turns_reduction"] = (
            1 - on.ttft_p50_later_turns_s / off.ttft_p50_later_turns_s
        )
    return entry


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto", help="auto: as the engine chooses")
    parser.add_argument("--workload", choices=["chat", "document", "all"], default="all")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=600)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument(
        "--think-time-s", type=float, default=1.0, help="mean user think time between turns"
    )
    parser.add_argument("--doc-requests", type=int, default=64)
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--doc-output-tokens", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--out", default="bench/results/prefix.json")
    args = parser.parse_args(argv)

    from worker import LLMEngine, engine_config
    from worker.model.default_model import resolve_model_path

    model_path = resolve_model_path(args.model)
    engine = LLMEngine(
        model_path,
        engine_config(dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens),
    )
    warmup = argparse.Namespace(
        **{**vars(args), "sessions": 2, "turns": 2, "answer_tokens": 4, "think_time_s": 0.0}
    )
    warmup.system_tokens = 48
    run_chat(engine, warmup)  # oneDNN weight packing and allocator warm-up, not measured
    report: dict = {
        "model": str(model_path),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "args": vars(args),
    }
    runs = {"chat": run_chat, "document": run_document}
    names = list(runs) if args.workload == "all" else [args.workload]
    for name in names:
        off = measure(engine, runs[name], args, caching=False)
        on = measure(engine, runs[name], args, caching=True)
        report[name] = compare(off, on)
        summary = {k: v for k, v in report[name].items() if k not in ("off", "on")}
        print(f"{name}: {json.dumps(summary)}", flush=True)
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
