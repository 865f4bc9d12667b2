"""The native decode step (switchboard_kernels/decode_step_cpu.c) against the torch path it
replaces, in one engine: the same requests with the step taken natively and with it turned
off, alternated ``--repeats`` times, medians.

Decode-bound workloads on the default model: batch 1 (one request of 16 prompt tokens,
``--tokens`` out; tok/s is 1 / its median time per output token), and ``--batch`` requests
(128 prompt tokens, ``--tokens`` out, all at once; output tok/s), each on the base model and
with ``--adapters`` K random rank 8-16 adapters on every projection, the requests spread
evenly over them (``bench.lora``'s adapters). ``--quantization`` / ``--lm-head`` quantize the
base on load. Both paths compute the same logits bit for bit (tests/kernels/
test_decode_step_native.py); this measures what the ~330 Python-dispatched ops of a step cost.

Usage: ``python -m bench.decode_step [--model DIR] [--batch 32] [--tokens 64] [--adapters 8]
[--repeats 3] [--quantization int4|int8] [--lm-head int4|int8] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.lora import assign, make_adapters
from bench.lora import run_engine as run_with_adapters
from bench.report import write_report
from bench.throughput import run_engine
from bench.workloads import BenchRequest, fixed_lengths


def alternated(runner, repeats: int, measure) -> dict[str, float]:
    """``measure()`` with the native step on and off, alternated; the median of each."""
    step = runner.native_step
    runs: dict[str, list[float]] = {"native": [], "torch": []}
    try:
        for _ in range(repeats):
            for side in runs:
                runner.native_step = step if side == "native" else None
                runs[side].append(measure())
    finally:
        runner.native_step = step
    medians = {side: statistics.median(values) for side, values in runs.items()}
    return {**medians, "ratio": medians["native"] / medians["torch"]}


def main(argv: list[str] | None = None) -> dict:
    from worker import LLM
    from worker.model.default_model import resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a checkpoint (default: the default model)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantization", choices=["int4", "int8"])
    parser.add_argument("--lm-head", choices=["int4", "int8"])
    parser.add_argument("--out", type=Path, default=Path("bench/results/decode_step.json"))
    args = parser.parse_args(argv)

    model = resolve_model_path(args.model)
    options = {"dtype": "bfloat16", "kernel_choice": "fixed", "max_loras": max(args.adapters, 1)}
    if args.quantization:
        options["quantization"] = args.quantization
    if args.lm_head:
        options["quantization_lm_head"] = args.lm_head
    llm = LLM(model, **options)
    runner = llm.engine.runner
    if runner.native_step is None:
        raise SystemExit("the native decode step does not serve this model here")
    engine = llm.engine

    prompt = list(range(100, 116))
    results: dict = {"options": options, "tokens": args.tokens}

    def batch_one() -> float:
        return 1.0 / run_engine(engine, [BenchRequest(prompt, args.tokens)], "b1").tpot_p50_s

    results["batch_1_tok_per_s"] = alternated(runner, args.repeats, batch_one)
    vocab = llm.engine.runner.model.config.vocab_size
    requests = fixed_lengths(args.batch, prompt_len=128, output_len=args.tokens, vocab=vocab)

    def batch_base() -> float:
        return run_engine(engine, requests, "batch").output_tok_per_s

    results[f"batch_{args.batch}_tok_per_s"] = alternated(runner, args.repeats, batch_base)
    if args.adapters:
        with tempfile.TemporaryDirectory() as tmp:
            paths = make_adapters(model, Path(tmp), args.adapters)
            names = []
            for i, path in enumerate(paths):
                llm.load_adapter(f"a{i}", path)
                names.append(f"a{i}")
            picks = [names[i] for i in assign(len(requests), len(names), "uniform")]
            run_with_adapters(engine, requests, picks, "warm")  # every adapter in a slot

            def batch_adapters() -> float:
                return run_with_adapters(engine, requests, picks, "lora").output_tok_per_s

            key = f"batch_{args.batch}_{args.adapters}_adapters_tok_per_s"
            results[key] = alternated(runner, args.repeats, batch_adapters)
            lora, base = results[key], results[f"batch_{args.batch}_tok_per_s"]
            results["adapters_over_base"] = {
                side: lora[side] / base[side] for side in ("native", "torch")
            }
    for name, value in results.items():
        print(f"{name}: {value}")
    write_report(results, args.out)
    return results


if __name__ == "__main__":
    main()
