"""What each piece of the speculative policy adds: the speculating engine with one piece
taken out at a time, beside plain decoding and the whole policy, on bench.spec's workloads.

Pieces (each variant removes one; the engine's code is not changed, the variant's engine is
built with a setting or has one policy method replaced after it is built):

- ``no-alternatives``: the draft offers no runner-up tokens (``speculative_alternatives=0``);
- ``no-plan``: a draft model's chains are sized by the per-sequence back-off, not by the
  step's plan of candidates by the draft's calibrated confidence (``draft_plan``);
- ``flat-cost``: verification rows cost a fixed 2% of a step each, not the measured table
  corrected by live step times (``step_cost``);
- ``no-pauses``: a sequence whose drafts do not pay keeps drafting (no pause and probe).

Two pieces this measured did not pay and are gone (docs/speculative-decoding.md has the
figures): the draft's measured pass time (its weights' ratio did as well) and a check of the
whole step beside each sequence's own count.

Usage: ``python -m bench.spec_ablation [--proposer draft|ngram] [--only chat_batch1 ...]``.
Engines run interleaved, the fastest of ``--repeats`` runs of each kept, as in bench.spec.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.report import write_report
from bench.spec import prompts, run

DRAFT_VARIANTS = (
    "all",
    "no-alternatives",
    "no-plan",
    "flat-cost",
    "no-pauses",
)
NGRAM_VARIANTS = ("all", "flat-cost", "no-pauses")


def build(model: Path, speculative_model: str, variant: str, k: int, dtype: str):
    """An LLM speculating with ``speculative_model``, the policy's ``variant`` piece out."""
    from worker import LLM

    options: dict = {"speculative_model": speculative_model, "num_speculative_tokens": k}
    if variant == "no-alternatives":
        options["speculative_alternatives"] = 0
    if variant == "flat-cost":
        options["speculative_position_cost"] = 0.02
    llm = LLM(model, dtype=dtype, **options)
    speculator = llm.engine.speculator
    assert speculator is not None
    policy = speculator.policy
    if variant == "no-plan":
        speculator.proposer.ranks_candidates = False
    elif variant == "no-pauses":
        policy._pause = lambda track: None
    return llm


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="target checkpoint (default: SmolLM2-135M)")
    parser.add_argument("--draft", default=None, help="draft checkpoint (default: the distilled)")
    parser.add_argument("--proposer", choices=["draft", "ngram"], default="draft")
    parser.add_argument("--variants", nargs="*", default=None, help="default: all of them")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--only", nargs="*", default=["chat_batch1", "grounded_batch1", "chat_batch4"]
    )
    parser.add_argument("--out", default="bench/results/spec_ablation.json")
    args = parser.parse_args(argv)

    from training.draft_distill import default_draft_path
    from worker import LLM
    from worker.model.default_model import resolve_model_path

    model = resolve_model_path(args.model)
    if args.proposer == "draft":
        draft = Path(args.draft) if args.draft else default_draft_path()
        if not (draft / "config.json").is_file():
            raise SystemExit(f"no draft at {draft}: run `switchboard draft distill` first")
        speculative_model, variants = str(draft), DRAFT_VARIANTS
    else:
        speculative_model, variants = "ngram", NGRAM_VARIANTS
    variants = tuple(args.variants) if args.variants else variants
    engines = {"off": LLM(model, dtype=args.dtype)}
    for variant in variants:
        engines[variant] = build(model, speculative_model, variant, args.k, args.dtype)
    tokenizer = engines["off"].tokenizer
    for llm in engines.values():  # weight packing and allocator warm-up, not measured
        llm.generate(prompts(tokenizer, "chat", 2), None)
    report: dict = {
        "model": str(model),
        "proposer": speculative_model,
        "threads": torch.get_num_threads(),
        "args": vars(args),
    }
    for key in args.only:
        workload, batch_text = key.split("_batch")
        batch = int(batch_text)
        texts = prompts(tokenizer, workload, args.num_prompts if batch == 1 else batch)
        runs: dict[str, dict] = {}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                r = run(llm, texts, batch, args.max_tokens)
                if name not in runs or r["elapsed_s"] < runs[name]["elapsed_s"]:
                    runs[name] = r
        base = runs["off"]
        for r in runs.values():
            r["speedup"] = round(r["output_tok_per_s"] / base["output_tok_per_s"], 3)
            del r["token_ids"]
        report[key] = runs
        summary = {name: r["speedup"] for name, r in runs.items()}
        print(f"{key}: {json.dumps(summary)}", flush=True)
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
