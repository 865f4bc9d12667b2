"""DoRA's cost in a batch: the same requests on DoRA adapters vs on the same adapters as plain
LoRA (the same A and B, no magnitudes), alternated in one process.

Workload: N requests x P prompt tokens x O output tokens (ignore_eos), spread evenly over K
adapters (rank 8-16 on all seven projections of every layer, ``bench.lora``'s); the DoRA
copies add a magnitude per output feature of every projection (the base rows' norms times
0.9-1.1). Each side runs ``--repeats`` times, alternated; the medians and their ratio are
reported, beside the base model on the same requests.
Usage: ``python -m bench.dora [--adapters 8] [--requests 32] [--out results.json]``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

from bench.lora import compare_sides, make_adapters, median, side_by_side_arguments
from bench.report import write_report
from bench.workloads import fixed_lengths


def dora_copy(plain: Path, out: Path, model_path: Path, seed: int) -> Path:
    """``plain`` with a DoRA magnitude on every adapted projection."""
    from safetensors.torch import load_file, save_file

    from worker.model.dora import BaseWeights

    if (out / "adapter_model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    base = BaseWeights(model_path, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(plain / "adapter_model.safetensors")
    for name in [n for n in tensors if n.endswith(".lora_A.weight")]:
        parts = name.split(".")  # base_model.model.model.layers.<i>.<parent>.<module>.lora_A...
        norms = base.projection(int(parts[4]), parts[6]).norm(dim=1)
        factor = 0.9 + 0.2 * torch.rand(norms.shape, generator=gen)
        magnitude = name.replace(".lora_A.weight", ".lora_magnitude_vector")
        tensors[magnitude] = (norms * factor).to(tensors[name].dtype)
    save_file(tensors, out / "adapter_model.safetensors")
    config = json.loads((plain / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    side_by_side_arguments(parser, adapters=8, name="dora")
    args = parser.parse_args(argv)

    from worker import LLMEngine, engine_config
    from worker.model.default_model import resolve_model_path

    model_path = resolve_model_path(args.model)
    plain = make_adapters(model_path, Path(args.workdir), args.adapters)
    dora = [dora_copy(p, p.with_name(p.name + "-dora"), model_path, i) for i, p in enumerate(plain)]
    engine = LLMEngine(
        model_path,
        engine_config(
            dtype=args.dtype,
            device=args.device,
            max_loras=2 * args.adapters,
            max_lora_rank=16,
            max_num_seqs=max(64, args.requests),
        ),
    )
    for i, (p, d) in enumerate(zip(plain, dora, strict=True)):
        engine.load_adapter(f"plain-{i}", p)
        engine.load_adapter(f"dora-{i}", d)
    requests = fixed_lengths(
        args.requests,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        vocab=engine.config.vocab_size,
    )
    picks = [i % args.adapters for i in range(args.requests)]
    sides = {
        "base": [None] * args.requests,
        "plain LoRA": [f"plain-{k}" for k in picks],
        "DoRA": [f"dora-{k}" for k in picks],
    }
    runs = compare_sides(engine, requests, sides, args.repeats)
    best = {name: median(r) for name, r in runs.items()}
    ratio = best["DoRA"].output_tok_per_s / best["plain LoRA"].output_tok_per_s
    best["DoRA"].note = f"{ratio:.1%} of plain LoRA"
    for run in best.values():
        print(json.dumps(asdict(run)))
    report = {
        "model": str(model_path),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "adapters": args.adapters,
        "runs": [asdict(r) for r in best.values()],
        "dora_over_plain": ratio,
    }
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
