"""What the native bf16 projections (``switchboard_kernels/linear_bf16_cpu.c``) give the engine: two
engines on the default model, one with ``switchboard_kernels.linear.bf16_panels_preferred`` off (its
projections through oneDNN's packed matmul, the path before the kernel), run interleaved.

With ``--against float32`` the other engine runs the model in fp32 instead (oneDNN's fp32
matmul): whether bf16 with the kernel is the right ``dtype="auto"`` on this CPU.

Workloads: ``b<N>`` is N requests of 128 prompt / 128 output tokens at once (greedy,
``ignore_eos``); ``W2`` is bench.throughput's long-tailed 128 requests. Reports each
engine's output tok/s per run and the median ratio. Usage: ``python -m
bench.bf16_projections [--workloads b1 b8 b32 W2] [--repeats 4] [--against float32]``.
"""

from __future__ import annotations

import argparse
import statistics

from bench.report import write_report
from bench.vllm_side_by_side import requests_for, run_ours
from bench.workloads import fixed_lengths


def requests(name: str, vocab: int, seed: int):
    if name == "W2":
        return requests_for("W2", vocab, seed)[0]
    return fixed_lengths(int(name[1:]), prompt_len=128, output_len=128, vocab=vocab, seed=seed)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workloads", nargs="+", default=["b1", "b8", "b32"])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--against", choices=["onednn", "float32"], default="onednn")
    parser.add_argument("--out", default="bench/results/bf16_projections.json")
    args = parser.parse_args(argv)

    import switchboard_kernels.linear
    from worker import LLMEngine, engine_config
    from worker.model.default_model import resolve_model_path

    path, config = resolve_model_path(None), engine_config(dtype="bfloat16")
    other = args.against
    if other == "float32":
        engines = {other: LLMEngine(path, engine_config(dtype="float32"))}
    else:
        preferred = switchboard_kernels.linear.bf16_panels_preferred
        switchboard_kernels.linear.bf16_panels_preferred = lambda weight: False
        try:
            engines = {other: LLMEngine(path, config)}
        finally:
            switchboard_kernels.linear.bf16_panels_preferred = preferred
    engines["native"] = LLMEngine(path, config)
    vocab = engines["native"].config.vocab_size
    report: dict = {"workloads": {}}
    for name in args.workloads:
        warm, timed = requests(name, vocab, seed=1), requests(name, vocab, seed=0)
        runs: dict[str, list[float]] = {engine: [] for engine in engines}
        for engine in engines.values():
            run_ours(engine, warm[:16], sequential=False)
        for _ in range(args.repeats):
            for label, engine in engines.items():
                tokens, seconds = run_ours(engine, timed, sequential=False)
                runs[label].append(tokens / seconds)
        pairs = zip(runs["native"], runs[other], strict=True)
        ratio = statistics.median(native / base for native, base in pairs)
        report["workloads"][name] = {"tok_s": runs, f"native_over_{other}": ratio}
        print(f"{name}: {runs}, native / {other} {ratio:.2f}x", flush=True)
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
