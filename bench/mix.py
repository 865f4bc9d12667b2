"""A mix's cost in a batch: the same requests each on a weighted mix of two adapters vs each on
one adapter, alternated in one process (issue 47's bar: within 15% of one adapter).

Workload: N requests x P prompt tokens x O output tokens (ignore_eos). With K adapters
(``bench.lora``'s: rank 8-16 on all seven projections of every layer), request i runs on
adapter i mod K alone, or on the mix 0.7 x adapter i mod K + 0.3 x adapter (i + 1) mod K (K = 1:
adapters 0 and 1). Each side runs ``--repeats`` times, alternated with the base model on the
same requests; the medians and the mix / one-adapter ratio are reported, and the same ratio
of each side's fastest run (other processes on a shared machine only slow a run down).
Usage: ``python -m bench.mix [--adapters 1] [--requests 32] [--out results.json]``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from bench.lora import compare_sides, make_adapters, median, side_by_side_arguments
from bench.report import write_report
from bench.workloads import fixed_lengths


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    side_by_side_arguments(parser, adapters=1, name="mix")
    args = parser.parse_args(argv)

    from worker import LLMEngine, engine_config
    from worker.model.default_model import resolve_model_path

    model_path = resolve_model_path(args.model)
    count = max(args.adapters, 2)
    paths = make_adapters(model_path, Path(args.workdir), count)
    engine = LLMEngine(
        model_path,
        engine_config(
            dtype=args.dtype,
            device=args.device,
            max_loras=count,
            max_lora_rank=16,
            max_num_seqs=max(64, args.requests),
        ),
    )
    for i, path in enumerate(paths):
        engine.load_adapter(f"lora-{i}", path)
    requests = fixed_lengths(
        args.requests,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        vocab=engine.config.vocab_size,
    )
    picks = [i % args.adapters for i in range(args.requests)]
    sides: dict[str, list] = {
        "base": [None] * args.requests,
        "one adapter": [f"lora-{k}" for k in picks],
        "mix of two": [[(f"lora-{k}", 0.7), (f"lora-{(k + 1) % count}", 0.3)] for k in picks],
    }
    runs = compare_sides(engine, requests, sides, args.repeats)
    best = {name: median(r) for name, r in runs.items()}
    ratio = best["mix of two"].output_tok_per_s / best["one adapter"].output_tok_per_s
    best["mix of two"].note = f"{ratio:.1%} of one adapter"
    # The fastest run of each side too: on a shared machine other processes only slow a run.
    fastest = {name: max(r, key=lambda run: run.output_tok_per_s) for name, r in runs.items()}
    fastest_ratio = fastest["mix of two"].output_tok_per_s / fastest["one adapter"].output_tok_per_s
    for run in best.values():
        print(json.dumps(asdict(run)))
    print(f"fastest runs: mix of two {fastest_ratio:.1%} of one adapter")
    report = {
        "model": str(model_path),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "adapters": args.adapters,
        "runs": [asdict(r) for r in best.values()],
        "mix_over_one": ratio,
        "fastest": [asdict(r) for r in fastest.values()],
        "fastest_mix_over_one": fastest_ratio,
    }
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
