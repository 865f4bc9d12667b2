"""Engine throughput vs Hugging Face ``generate`` (static batching), in one process.

W1: 32 requests x 128 prompt tokens x 128 output tokens (ignore_eos).
W2: 128 requests with seeded long-tailed prompt (16-1024) and output (8-512) lengths.
The baseline runs in the same process right after the engine, so machine noise hits both.
Usage: ``python -m bench.throughput [--workload W1|W2|all] [--batch-invariant]
[--out results.json]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from bench.report import write_report
from bench.workloads import BenchRequest, fixed_lengths, long_tailed


@dataclass
class RunResult:
    name: str
    num_requests: int
    output_tokens: int
    elapsed_s: float
    output_tok_per_s: float
    requests_per_s: float
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p99_s: float | None = None
    kv_utilization: float | None = None
    peak_rss_mb: float | None = None
    note: str = ""


def workload(name: str, vocab: int) -> list[BenchRequest]:
    if name == "W1":
        return fixed_lengths(32, prompt_len=128, output_len=128, vocab=vocab)
    return long_tailed(128, vocab=vocab)


def run_engine(engine, requests: list[BenchRequest], name: str) -> RunResult:
    from worker import SamplingParams

    start = time.monotonic()
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(f"{name}-{i}", r.prompt_token_ids, params)
    finished = []
    utilization = []
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                finished.append(out)
        utilization.append(kv_utilization(engine))
    elapsed = time.monotonic() - start
    ttft = [o.metrics.first_token_time - start for o in finished]
    tpot = [
        (o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.token_ids) - 1)
        for o in finished
        if len(o.token_ids) > 1
    ]
    tokens = sum(len(o.token_ids) for o in finished)
    return RunResult(
        name=f"engine {name}",
        num_requests=len(finished),
        output_tokens=tokens,
        elapsed_s=elapsed,
        output_tok_per_s=tokens / elapsed,
        requests_per_s=len(finished) / elapsed,
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        tpot_p50_s=float(np.percentile(tpot, 50)),
        tpot_p99_s=float(np.percentile(tpot, 99)),
        kv_utilization=float(np.mean([u for u in utilization if u is not None])),
        peak_rss_mb=peak_rss_mb(),
    )


def kv_utilization(engine) -> float | None:
    """Live token slots over allocated slots, across running sequences."""
    running = engine.scheduler.running
    allocated = sum(len(s.block_table) for s in running) * engine.block_manager.block_size
    if allocated == 0:
        return None
    return sum(s.num_computed_tokens for s in running) / allocated


def run_hf(
    model, requests: list[BenchRequest], batch_size: int, name: str, note: str = ""
) -> RunResult:
    """Static batching: each batch is left-padded and runs until its longest output is done."""
    from transformers import GenerationConfig

    start = time.monotonic()
    useful = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids) :] = 1
        new = max(r.output_len for r in batch)
        config = GenerationConfig(
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, generation_config=config)
        useful += sum(r.output_len for r in batch)
    elapsed = time.monotonic() - start
    return RunResult(
        name=f"hf-generate {name} batch={batch_size}",
        num_requests=len(requests),
        output_tokens=useful,
        elapsed_s=elapsed,
        output_tok_per_s=useful / elapsed,
        requests_per_s=len(requests) / elapsed,
        note=note,
    )


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def hf_best(model_path: Path, requests, name: str, batch_sizes, subset: int | None, dtype):
    """HF at each batch size (on a seeded subset for long workloads); the best one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    note = ""
    if subset and subset < len(requests):
        rng = np.random.default_rng(1)
        picked = sorted(rng.choice(len(requests), subset, replace=False).tolist())
        requests = [requests[i] for i in picked]
        note = f"seeded subset of {subset} requests; tok/s is scale-free"
    results = [run_hf(model, requests, b, name, note) for b in batch_sizes]
    for r in results:
        print(f"  {r.name}: {r.output_tok_per_s:.1f} tok/s")
    return max(results, key=lambda r: r.output_tok_per_s)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto", help="auto: as the engine chooses")
    parser.add_argument("--workload", choices=["W1", "W2", "all"], default="all")
    parser.add_argument("--no-baseline", action="store_true", help="skip HF generate")
    parser.add_argument("--hf-batch-sizes", default="8,16,32")
    parser.add_argument("--w2-hf-subset", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--batch-invariant", action="store_true", help="the engine's setting")
    parser.add_argument("--out", default="bench/results/throughput.json")
    args = parser.parse_args(argv)

    from worker import LLMEngine, engine_config
    from worker.model.default_model import resolve_model_path

    model_path = resolve_model_path(args.model)
    engine = LLMEngine(
        model_path,
        engine_config(
            dtype=args.dtype,
            max_num_batched_tokens=args.max_num_batched_tokens,
            batch_invariant=args.batch_invariant,
        ),
    )
    vocab = engine.config.vocab_size
    names = ["W1", "W2"] if args.workload == "all" else [args.workload]
    report: dict = {
        "model": str(model_path),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "batch_invariant": args.batch_invariant,
    }
    for name in names:
        requests = workload(name, vocab)
        run_engine(engine, requests[:4], f"{name}-warmup")
        result = run_engine(engine, requests, name)
        print(json.dumps(asdict(result), indent=1))
        entry = {"engine": asdict(result)}
        if not args.no_baseline:
            batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
            subset = args.w2_hf_subset if name == "W2" else None
            best = hf_best(model_path, requests, name, batch_sizes, subset, engine.model.dtype)
            entry["hf_best"] = asdict(best)
            entry["speedup_vs_hf"] = result.output_tok_per_s / best.output_tok_per_s
            print(
                f"{name}: engine {result.output_tok_per_s:.1f} tok/s, HF best "
                f"{best.output_tok_per_s:.1f} tok/s -> {entry['speedup_vs_hf']:.2f}x"
            )
        report[name] = entry
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
