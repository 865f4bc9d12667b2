"""Structured outputs: what compiling a schema costs, and what constrained decoding costs.

Compile: each schema of the suite (the shapes tests/worker/test_structured_engine.py checks, plus a
larger one) compiled for the default model's vocabulary, cold (a fresh compiler; its
tokenizer view is built once beforehand and reported apart) and cached (the same schema
again: a cache hit and a copy of the matcher).

Throughput: the same prompts at batch 1 and 32, unconstrained and constrained by a JSON
schema that cannot end within ``--max-tokens`` (an array of at least 50 records), so both
generate exactly ``--max-tokens`` tokens a request; the two run interleaved, ``--repeats``
times each. The cost is one minus the median ratio of each constrained run to the free run
just before it (this machine's forward pass drifts by 5-10% between runs, more than
constraining costs; pairs cancel the drift); the fastest runs' ratio is reported beside it.
Usage: ``python -m bench.structured [--batch-sizes 1 32]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.report import write_report

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"enum": ["new", "vip", "blocked"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "active"],
    "additionalProperties": False,
}
SUITE = {
    "nested-objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                        "required": ["city"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["user"],
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
    },
    "array-with-bounds": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
    },
    "integer-range-and-optional-fields": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "nickname": {"type": "string"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["age"],
    },
    "records": {"type": "array", "items": RECORD, "minItems": 50},
    "forty-fields": {
        "type": "object",
        "properties": {f"field_{i}": {"type": ["string", "integer", "null"]} for i in range(40)},
        "required": [f"field_{i}" for i in range(0, 40, 2)],
    },
}
PROMPT = "List the customers of the shop as JSON records, one per person, starting now: "


def compile_times(engine, repeats: int) -> dict:
    """Per schema: cold and cached compile time (ms), median of ``repeats``."""
    from worker.sampling.grammar import GrammarCompiler
    from worker.sampling.structured_output import StructuredOutput

    started = time.perf_counter()
    tokenizer = GrammarCompiler(
        engine.tokenizer,
        vocab_size=engine.config.vocab_size,
        eos_token_ids=engine.config.eos_token_ids,
    ).tokenizer
    report = {"tokenizer_view_ms": (time.perf_counter() - started) * 1e3, "schemas": {}}
    for name, schema in SUITE.items():
        spec = StructuredOutput.json_schema(schema)
        cold, cached = [], []
        for _ in range(repeats):
            compiler = GrammarCompiler(
                engine.tokenizer,
                vocab_size=engine.config.vocab_size,
                eos_token_ids=engine.config.eos_token_ids,
            )
            compiler._tokenizer = tokenizer  # the per-model part, built once (reported above)
            started = time.perf_counter()
            compiler.matcher(spec)
            cold.append((time.perf_counter() - started) * 1e3)
            started = time.perf_counter()
            compiler.matcher(spec)
            cached.append((time.perf_counter() - started) * 1e3)
        report["schemas"][name] = {
            "cold_ms": statistics.median(cold),
            "cached_ms": statistics.median(cached),
        }
    return report


def run_batch(engine, batch: int, max_tokens: int, constrained: bool) -> float:
    """Output tokens per second for ``batch`` requests at once."""
    return timed_batch(engine, batch, max_tokens, constrained)[0]


def timed_batch(engine, batch: int, max_tokens: int, constrained: bool) -> tuple[float, float]:
    """Output tokens per second, and the share of the run's time spent masking logits and
    feeding tokens to the matchers (the work constraining adds to a step, timed directly:
    unlike the throughput ratio it does not drift with the machine)."""
    from worker.sampling.grammar import GrammarState

    spent = [0.0]

    def timing(fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - started

        return timed

    consume = GrammarState.consume
    engine._apply_grammars = timing(engine._apply_grammars)
    GrammarState.consume = timing(consume)
    try:
        tok_s, elapsed = _run(engine, batch, max_tokens, constrained)
    finally:
        del engine._apply_grammars  # the class's method again
        GrammarState.consume = consume
    return tok_s, spent[0] / elapsed


def _run(engine, batch: int, max_tokens: int, constrained: bool) -> tuple[float, float]:
    from worker import SamplingParams
    from worker.sampling.structured_output import StructuredOutput

    spec = StructuredOutput.json_schema(SUITE["records"]) if constrained else None
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_output=spec
    )
    ids = [f"r{i}" for i in range(batch)]
    started = time.perf_counter()
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, f"{PROMPT}(batch {i})", params)
    generated = 0
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                generated += len(out.token_ids)
    elapsed = time.perf_counter() - started
    assert generated == batch * max_tokens, "a constrained request ended early"
    return generated / elapsed, elapsed


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results/structured.json")
    args = parser.parse_args(argv)

    from worker import LLMEngine, engine_config
    from worker.model.default_model import resolve_model_path

    model_path = resolve_model_path(args.model)
    engine = LLMEngine(model_path, engine_config(dtype=args.dtype))
    report: dict = {
        "model": str(model_path),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "args": vars(args),
        "compile": compile_times(engine, args.repeats),
    }
    print(json.dumps(report["compile"], indent=1), flush=True)
    run_batch(engine, 4, 16, constrained=True)  # warm-up: weights, allocator, matcher paths
    run_batch(engine, 4, 16, constrained=False)
    report["throughput"] = {}
    for batch in args.batch_sizes:
        runs: dict[str, list[float]] = {"free": [], "constrained": []}
        shares = []
        for _ in range(args.repeats):
            for name in runs:
                engine.reset_prefix_cache()
                tok_s, share = timed_batch(engine, batch, args.max_tokens, name == "constrained")
                runs[name].append(tok_s)
                if name == "constrained":
                    shares.append(share)
        free, constrained = max(runs["free"]), max(runs["constrained"])
        paired = [c / f for f, c in zip(runs["free"], runs["constrained"], strict=True)]
        report["throughput"][str(batch)] = {
            "free_tok_s": free,
            "constrained_tok_s": constrained,
            "cost": 1.0 - statistics.median(paired),
            "cost_of_fastest": 1.0 - constrained / free,
            "grammar_work_share": statistics.median(shares),
            "runs": runs,
        }
        print(f"batch {batch}: {json.dumps(report['throughput'][str(batch)])}", flush=True)
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
