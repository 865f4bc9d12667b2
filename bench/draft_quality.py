"""How well a draft predicts its target, timing nothing: a minute's check of a distillation.

The target answers held-out questions greedily (bench.spec's eight and eight more, none of
them the distillation's instructions); each draft then reads those answers, teacher-forced,
and at every answer position we count whether the target's token is among the draft's
1, 2, 4 or 8 most likely (over the draft's output columns). ``chain k`` replays greedy
speculation with a fixed chain of k drafts along each answer: the tokens one verification
gives on average (the matches in a row, capped at k, plus the target's own token).
``--int8`` ranks each draft a second time with its projections and output layer rounded as
the engine holds them in int8 (``speculative_draft_quantization``, fp32 CPUs).
Usage: ``python -m bench.draft_quality [--draft DIR ...] [--max-tokens 128] [--int8]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.spec import QUESTIONS, chat_prompts

MORE_QUESTIONS = [
    "How does a refrigerator keep food cold?",
    "What should I pack for a weekend of hiking?",
    "Explain what a mortgage is.",
    "Write a haiku about autumn leaves.",
    "Why do we need sleep?",
    "How do airplanes stay in the air?",
    "Give me a simple recipe for pancakes.",
    "What causes the seasons on Earth?",
]
TOP_KS = (1, 2, 4, 8)
CHAIN_KS = (1, 2, 4)


def target_answers(target: Path, max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy answer ids) per question, as the engine generates them."""
    from worker import LLM, SamplingParams

    llm = LLM(target, dtype="auto")
    texts = chat_prompts(llm.tokenizer, QUESTIONS + MORE_QUESTIONS)
    outputs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [o.prompt_token_ids for o in outputs], [o.token_ids for o in outputs]


def chain_tokens(matches: list[bool], k: int) -> float:
    """Tokens per verification of greedy speculation with k drafts along one answer, where
    ``matches[j]`` says the draft's top token is the target's at answer position j."""
    position, steps = 0, 0
    while position < len(matches):
        accepted = 0
        while accepted < k and position + accepted < len(matches) - 1:
            if not matches[position + accepted]:
                break
            accepted += 1
        position += accepted + 1  # the accepted drafts and the target's own token
        steps += 1
    return len(matches) / max(1, steps)


def round_to_int8(model) -> None:
    """The model's projections and output layer as the engine's int8 panels hold them (the
    embedding, which the output layer may share, stays exact, as in the engine)."""
    from switchboard_kernels.linear_native import PanelLinear

    def rounded(weight: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(PanelLinear(weight.detach(), int8=True).dequantized())

    for layer in model.model.layers:
        for module in (*layer.self_attn.children(), *layer.mlp.children()):
            if isinstance(module, torch.nn.Linear):
                module.weight = rounded(module.weight)
    model.lm_head.weight = rounded(model.lm_head.weight)  # untied from the embedding


def draft_quality(
    draft: Path, prompts: list[list[int]], answers: list[list[int]], *, int8: bool = False
) -> dict:
    from transformers import AutoModelForCausalLM

    from worker.spec_decode.draft import read_output_vocab

    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    if int8:
        round_to_int8(model)
    columns = read_output_vocab(draft)
    hits = dict.fromkeys(TOP_KS, 0)
    chains = {k: [] for k in CHAIN_KS}
    positions = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]  # predicts each answer token
        if columns is not None:
            logits = logits[:, columns]
        ranked = logits.topk(max(TOP_KS), dim=-1).indices
        if columns is not None:
            ranked = columns[ranked]
        truth = torch.tensor(answer)[:, None]
        for k in TOP_KS:
            hits[k] += int((ranked[:, :k] == truth).any(-1).sum())
        matches = (ranked[:, 0] == truth[:, 0]).tolist()
        for k in CHAIN_KS:
            chains[k].append(chain_tokens(matches, k))
        positions += len(answer)
    return {
        "draft": str(draft),
        "weights": "int8" if int8 else "fp32",
        "positions": positions,
        **{f"top{k}": hits[k] / positions for k in TOP_KS},
        **{f"chain{k}_tokens": sum(v) / len(v) for k, v in chains.items()},
    }


def main(argv: list[str] | None = None) -> list[dict]:
    from training.draft_distill import default_draft_path
    from worker.model.default_model import resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target checkpoint (default: the default model)")
    parser.add_argument("--draft", nargs="+", help="draft checkpoints (default: the distilled)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--int8", action="store_true", help="also with int8 weights")
    args = parser.parse_args(argv)
    prompts, answers = target_answers(resolve_model_path(args.model), args.max_tokens)
    drafts = [Path(d) for d in args.draft] if args.draft else [default_draft_path()]
    variants = (False, True) if args.int8 else (False,)
    results = [draft_quality(d, prompts, answers, int8=q) for d in drafts for q in variants]
    for result in results:
        print(json.dumps(result))
    return results


if __name__ == "__main__":
    main()
