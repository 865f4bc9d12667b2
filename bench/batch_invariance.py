"""What ``batch_invariant=True`` costs: the same steps through an engine with it and one
without (the default: the measured kernel plan, SDPA over prefill chunks), both in one
process, run alternately; each figure is the median and the best of many step times, so
that a busy machine still compares like with like.

decode-N: N requests decoding together (32-token prompts), the time of each step after
their prefill. prefill-N: one N-token prompt, the time of its one step (a fresh prompt each
time, so no prefix is cached).
Usage: ``python -m bench.batch_invariance [--dtype auto] [--repeats 2] [--prefills 3]
[--scenarios decode-1,decode-8,...] [--out bench/results/batch_invariance.json]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict

import numpy as np
import torch

from bench.report import write_report


def step_seconds(engine, prompts: list[list[int]], max_tokens: int, skip: int) -> list[float]:
    """Add the prompts, step until they finish; the wall time of each step after ``skip``."""
    from worker import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(f"r{time.monotonic_ns()}-{len(prompt)}", prompt, params)
    times = []
    while engine.has_unfinished_requests:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[skip:]


def scenario(name: str, vocab: int, rng: np.random.Generator) -> tuple[list[list[int]], int, int]:
    """(prompts, max_tokens, steps to skip) for ``decode-N`` or ``prefill-N``."""
    kind, n = name.split("-")
    if kind == "decode":
        return [rng.integers(3, vocab, 32).tolist() for _ in range(int(n))], 33, 1
    return [rng.integers(3, vocab, int(n)).tolist()], 1, 0


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto", help="auto: as the engine chooses")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prefills", type=int, default=3, help="prompts a prefill-N repeat")
    parser.add_argument(
        "--scenarios", default="decode-1,decode-8,decode-32,prefill-128,prefill-1000"
    )
    parser.add_argument("--out", default="bench/results/batch_invariance.json")
    args = parser.parse_args(argv)

    from worker import LLMEngine, engine_config
    from worker.model.default_model import resolve_model_path

    model_path = resolve_model_path(args.model)
    engines = {
        mode: LLMEngine(
            model_path,
            engine_config(
                dtype=args.dtype, kv_cache_memory_gb=0.5, batch_invariant=mode == "invariant"
            ),
        )
        for mode in ("default", "invariant")
    }
    vocab = engines["default"].config.vocab_size
    rng = np.random.default_rng(0)
    names = args.scenarios.split(",")
    times: dict[str, dict[str, list[float]]] = {n: {m: [] for m in engines} for n in names}
    for engine in engines.values():  # warm-up
        step_seconds(engine, [rng.integers(3, vocab, 40).tolist()] * 2, 4, 0)
    for _ in range(args.repeats):
        for name in names:
            for mode, engine in engines.items():
                for _ in range(1 if name.startswith("decode") else args.prefills):
                    times[name][mode] += step_seconds(engine, *scenario(name, vocab, rng))
                t = times[name][mode]
                print(f"  {name} {mode}: median {1e3 * statistics.median(t):.1f} ms", flush=True)
    report: dict = {
        "model": str(model_path),
        "dtype": str(engines["default"].model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "plans": {mode: asdict(e.model.linear_plan) for mode, e in engines.items()},
    }
    for name in names:
        row = {}
        for mode in engines:
            t = times[name][mode]
            row[mode] = {"median_ms": 1e3 * statistics.median(t), "best_ms": 1e3 * min(t)}
        row["slowdown_median"] = row["invariant"]["median_ms"] / row["default"]["median_ms"]
        row["slowdown_best"] = row["invariant"]["best_ms"] / row["default"]["best_ms"]
        report[name] = row
        print(
            f"{name}: default {row['default']['median_ms']:.1f} ms (best "
            f"{row['default']['best_ms']:.1f}), invariant {row['invariant']['median_ms']:.1f} ms "
            f"(best {row['invariant']['best_ms']:.1f}): {row['slowdown_median']:.2f}x "
            f"({row['slowdown_best']:.2f}x best)",
            flush=True,
        )
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
