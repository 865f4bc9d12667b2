"""Speculative decoding on vs off, on the default model, in one process.

Workloads (chat-templated, greedy, up to ``--max-tokens`` tokens each):
grounded: repeat / rewrite / summarize a given paragraph (outputs copy their input);
chat: open questions (outputs owe little to the prompt).
Each runs at batch 1 (``--num-prompts`` requests one after another) and at batch 16 (16
requests at once), with speculation off, with prompt lookup (``ngram``) and, when a draft
checkpoint is given or was distilled (``switchboard draft distill``), with the draft model.
All engines live in this process and run interleaved, ``--repeats`` times each; the fastest
run of each is kept (a concurrent process on these 2 cores only ever slows a run down).
Usage: ``python -m bench.spec [--draft DIR] [--k 4] [--out bench/results/spec.json]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.report import write_report

PARAGRAPHS = [
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, members agreed to increase funding for the public library by ten percent, to "
    "repair the roads on the north side of town, and to hire two new teachers for the primary "
    "school. The mayor thanked everyone for their hard work and said the plan would be "
    "published next week.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon "
    "dioxide into sugar and oxygen. It takes place mainly in the leaves, inside small "
    "structures called chloroplasts, which contain a green pigment named chlorophyll. The "
    "oxygen is released into the air, and the sugar feeds the plant as it grows.",
    "def moving_average(values, window):\n    result = []\n    total = 0.0\n    for i, value "
    "in enumerate(values):\n        total += value\n        if i >= window:\n            total "
    "-= values[i - window]\n        if i >= window - 1:\n            result.append(total / "
    "window)\n    return result\n",
    "Our store will be closed on Monday for the public holiday. Orders placed over the weekend "
    "will ship on Tuesday morning. Customers who need help can still reach the support team by "
    "email, and we will answer every message within one business day. Thank you for shopping "
    "with us.",
]
TASKS = [
    "Repeat the following text exactly, word for word:",
    "Rewrite the following text, keeping every sentence but fixing any mistakes:",
    "Copy the following text, then add one sentence summarizing it:",
]
QUESTIONS = [
    "What are some good habits for staying healthy?",
    "Explain how a rainbow forms.",
    "Give me three tips for learning a new language.",
    "Why is the sky blue?",
    "Write a short story about a cat who learns to swim.",
    "What is the difference between weather and climate?",
    "How do I make a cup of tea?",
    "Describe the water cycle in simple terms.",
]


def prompts(tokenizer, workload: str, num: int) -> list[str]:
    if workload == "grounded":
        messages = [
            f"{TASKS[i % len(TASKS)]}\n\n{PARAGRAPHS[i % len(PARAGRAPHS)]}" for i in range(num)
        ]
    else:
        messages = [QUESTIONS[i % len(QUESTIONS)] for i in range(num)]
    return chat_prompts(tokenizer, messages)


def chat_prompts(tokenizer, messages: list[str]) -> list[str]:
    """Each message as a one-turn chat, templated for the model to answer."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": m}], add_generation_prompt=True, tokenize=False
        )
        for m in messages
    ]


def run(llm, texts: list[str], batch: int, max_tokens: int, *, ignore_eos: bool = False) -> dict:
    """Generate for ``texts`` ``batch`` at a time; output tokens per second of wall time."""
    from worker import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    stats = llm.engine.spec_decode_stats
    before = stats.as_dict() if stats is not None else None
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(texts), batch):
        outputs += llm.generate(texts[i : i + batch], params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    # Decode alone (first token to last, per request): what speculation speeds up.
    decode_s = sum(o.metrics.last_token_time - o.metrics.first_token_time for o in outputs)
    result = {
        "output_tokens": tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tok_per_s": round(tokens / elapsed, 2),
        "token_ids": [o.token_ids for o in outputs],
    }
    if batch == 1:
        result["decode_tok_per_s"] = round((tokens - len(outputs)) / decode_s, 2)
    if stats is not None:
        after = stats.as_dict()
        proposed = after["num_proposed"] - before["num_proposed"]
        accepted = after["num_accepted"] - before["num_accepted"]
        verifications = after["num_verifications"] - before["num_verifications"]
        result["acceptance_rate"] = round(accepted / proposed, 3) if proposed else None
        result["mean_accepted_length"] = (
            round((accepted + verifications) / verifications, 3) if verifications else None
        )
        result["backoff_steps"] = after["num_backoff_steps"] - before["num_backoff_steps"]
        alternatives = after["num_alternatives"] - before["num_alternatives"]
        if alternatives:
            hits = after["num_alternatives_accepted"] - before["num_alternatives_accepted"]
            result["alternatives"] = alternatives
            result["alternatives_accepted"] = hits
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="target checkpoint (default: SmolLM2-135M)")
    parser.add_argument("--draft", default=None, help="draft checkpoint (default: the distilled)")
    parser.add_argument("--dtype", default="auto", help="auto: as the engine chooses")
    parser.add_argument("--k", type=int, default=16, help="num_speculative_tokens (most per step)")
    parser.add_argument("--num-prompts", type=int, default=4, help="batch-1 requests")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=4, help="runs of each; the best is kept")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every request runs to --max-tokens: the same work with and without speculation "
        "even where bf16 rounding flips a greedy output and moves its EOS",
    )
    parser.add_argument(
        "--alternatives",
        type=int,
        default=None,
        help="runner-up tokens the draft offers per draft (default: the engine's)",
    )
    parser.add_argument(
        "--chain-only",
        action="store_true",
        help="also run the draft without alternatives (engine 'draft-chain'), to compare",
    )
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        metavar="WORKLOAD_BATCH",
        help="run only these, e.g. chat_batch1 grounded_batch16 (default: all four)",
    )
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=[1, 16],
        help="requests at once: 1 runs --num-prompts one after another, B > 1 runs B at once "
        "(default: 1 16)",
    )
    parser.add_argument(
        "--draft-quantization",
        default=None,
        help="the draft's weights: auto, int4, int8 or none (default: the engine's, auto)",
    )
    parser.add_argument("--out", default="bench/results/spec.json")
    args = parser.parse_args(argv)

    from training.draft_distill import default_draft_path
    from worker import LLM
    from worker.model.default_model import resolve_model_path

    model = resolve_model_path(args.model)
    draft = Path(args.draft) if args.draft else default_draft_path()
    configs: dict[str, dict] = {"off": {}, "ngram": {"speculative_model": "ngram"}}
    if (draft / "config.json").is_file():
        configs["draft"] = {"speculative_model": str(draft)}
        if args.alternatives is not None:
            configs["draft"]["speculative_alternatives"] = args.alternatives
        if args.draft_quantization is not None:
            configs["draft"]["speculative_draft_quantization"] = args.draft_quantization
        if args.chain_only:
            configs["draft-chain"] = {
                "speculative_model": str(draft),
                "speculative_alternatives": 0,
            }
    engines = {
        name: LLM(model, dtype=args.dtype, num_speculative_tokens=args.k if kw else None, **kw)
        for name, kw in configs.items()
    }
    tokenizer = engines["off"].tokenizer
    for llm in engines.values():  # oneDNN packing and allocator warm-up, not measured
        llm.generate(prompts(tokenizer, "chat", 2), None)
    report: dict = {
        "model": str(model),
        "draft": str(draft) if "draft" in configs else None,
        "dtype": str(engines["off"].engine.model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "args": vars(args),
    }
    for workload in ("grounded", "chat"):
        for batch in args.batch_sizes:
            num = args.num_prompts if batch == 1 else batch
            key = f"{workload}_batch{batch}"
            if args.only and key not in args.only:
                continue
            texts = prompts(tokenizer, workload, num)
            runs: dict[str, dict] = {}
            for _ in range(args.repeats):  # interleaved; the fastest of each is kept
                for name, llm in engines.items():
                    r = run(llm, texts, batch, args.max_tokens, ignore_eos=args.ignore_eos)
                    if name not in runs or r["elapsed_s"] < runs[name]["elapsed_s"]:
                        runs[name] = r
            base = runs["off"]
            for r in runs.values():
                r["speedup"] = round(r["output_tok_per_s"] / base["output_tok_per_s"], 3)
                if batch == 1:
                    ratio = r["decode_tok_per_s"] / base["decode_tok_per_s"]
                    r["decode_speedup"] = round(ratio, 3)
                same = sum(a == b for a, b in zip(r["token_ids"], base["token_ids"], strict=True))
                r["same_tokens_as_off"] = f"{same}/{len(texts)}"
            for r in runs.values():
                del r["token_ids"]
            report[key] = runs
            print(f"{key}: {json.dumps(runs)}", flush=True)
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
