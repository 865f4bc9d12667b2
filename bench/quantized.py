"""A base quantized on load (``--quantization int4|int8``) against the bf16 engine, all in one
process, interleaved so machine noise hits each alike.

- ``decode``: batch-1 decode tok/s (one request, ``--decode-tokens`` output tokens; 1 / the
  median time per output token), each engine in turn, ``--repeats`` rounds; the ratio to bf16.
- ``w1``: W1 (32 requests x 128 prompt x 128 output tokens, ``bench.workloads``) output tok/s,
  each engine against bf16, interleaved likewise.
- ``quality``: the mean per-token KL divergence KL(bf16 || quantized) of the next-token
  distributions over a fixed prompt set (``bench.logit_fidelity``'s chat prompts, each followed
  by the bf16 engine's greedy answer), both engines scoring the same tokens (prompt logprobs'
  full fp32 logits); and how many greedy answers are the bf16 engine's.
- ``load``: /proc/loadavg before and after (these machines are shared: read the figures with it).

Usage: ``python -m bench.quantized [--model DIR] [--quick] [--repeats 3] [--lm-head int4|int8]
[--int4-group-size 32] [--no-w1] [--no-quality] [--threads N]
[--out bench/results/quantized.json]``. ``--quick``: about half a minute (a tiny random model
unless ``--model``; W1 cut to 8 x 32/32). ``--int4-group-size``: the int4 engine's input
features per scale and zero (the on-load default 32; it must divide every projection's input
features: 64 at most for the default model's 576).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from bench.logit_fidelity import PROMPTS
from bench.report import write_report
from bench.throughput import run_engine
from bench.workloads import BenchRequest, fixed_lengths

KINDS = ("bf16", "int4", "int8")


def load_average() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


def engines(
    model: Path, *, lm_head: str | None, max_num_batched_tokens: int, int4_group: int | None = None
) -> dict:
    from worker import LLM

    # The fixed kernel rule for all three: a measurement on a busy machine picks by its noise.
    options = {
        "dtype": "bfloat16",
        "max_num_batched_tokens": max_num_batched_tokens,
        "kernel_choice": "fixed",
    }
    head = {"quantization_lm_head": lm_head} if lm_head else {}
    group = {"quantization_group_size": int4_group} if int4_group else {}
    return {
        "bf16": LLM(model, **options),
        "int4": LLM(model, quantization="int4", **options, **head, **group),
        "int8": LLM(model, quantization="int8", **options, **head),
    }


def decode_rates(llms: dict, prompt: list[int], tokens: int, repeats: int) -> dict:
    """Batch-1 decode tok/s per engine: 1 / median time per output token, rounds interleaved."""
    times: dict[str, list[float]] = {k: [] for k in llms}
    for _ in range(repeats):
        for kind, llm in llms.items():
            result = run_engine(llm.engine, [BenchRequest(prompt, tokens)], f"decode-{kind}")
            times[kind].append(result.tpot_p50_s)
    rates = {k: 1.0 / statistics.median(v) for k, v in times.items()}
    return {
        "tok_per_s": rates,
        "ratio_to_bf16": {k: rates[k] / rates["bf16"] for k in rates if k != "bf16"},
    }


def w1_rates(llms: dict, requests: list[BenchRequest], repeats: int) -> dict:
    """W1 output tok/s per engine, rounds interleaved (the better of each); the ratio to bf16."""
    best: dict[str, float] = {}
    for _ in range(repeats):
        for kind, llm in llms.items():
            result = run_engine(llm.engine, requests, f"w1-{kind}")
            best[kind] = max(best.get(kind, 0.0), result.output_tok_per_s)
    ratios = {k: best[k] / best["bf16"] for k in best if k != "bf16"}
    return {"tok_per_s": best, "ratio_to_bf16": ratios}


def scored_logits(llm, tokens: list[int]) -> torch.Tensor:
    """The engine's fp32 logits [len(tokens) - 1, vocab] at every position but the last (its
    prompt logprobs' rows, captured as they are scored)."""
    from worker import SamplingParams
    from worker.model import prompt_logprobs

    captured: list[torch.Tensor] = []
    fill = prompt_logprobs._fill

    def keep(logits, targets):
        captured.append(logits.float().clone())
        return fill(logits, targets)

    prompt_logprobs._fill = keep
    try:
        llm.generate([tokens], SamplingParams(max_tokens=1, prompt_logprobs=0))
    finally:
        prompt_logprobs._fill = fill
    return torch.cat(captured)


def quality(llms: dict, prompts: list[list[int]], answer_tokens: int) -> dict:
    """Mean per-token KL(bf16 || q) over each prompt and the bf16 engine's greedy answer."""
    from worker import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True)
    answers = {k: [o.token_ids for o in llm.generate(prompts, greedy)] for k, llm in llms.items()}
    report = {}
    for kind in (k for k in llms if k != "bf16"):
        kls = []
        for prompt, answer in zip(prompts, answers["bf16"], strict=True):
            seq = prompt + answer
            p = torch.log_softmax(scored_logits(llms["bf16"], seq), -1)
            q = torch.log_softmax(scored_logits(llms[kind], seq), -1)
            kls.append((p.exp() * (p - q)).sum(-1))  # [positions]
        kl = torch.cat(kls)
        same = sum(a == b for a, b in zip(answers[kind], answers["bf16"], strict=True))
        report[kind] = {
            "mean_kl": float(kl.mean()),
            "p99_kl": float(kl.quantile(0.99)),
            "greedy_answers_equal_bf16": f"{same}/{len(prompts)}",
        }
    return report


def chat_prompts(llm) -> list[list[int]]:
    tok = llm.engine.tokenizer
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False
        )
        for p in PROMPTS
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: SmolLM2-135M)")
    parser.add_argument("--quick", action="store_true", help="seconds: small runs (tiny model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument(
        "--lm-head", choices=("int4", "int8"), default=None, help="quantize the output layer too"
    )
    parser.add_argument(
        "--int4-group-size", type=int, default=None, help="int4's features per group (32)"
    )
    parser.add_argument("--no-w1", action="store_true")
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (a busy machine: 1)"
    )
    parser.add_argument("--out", default="bench/results/quantized.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from worker.model.default_model import resolve_model_path

    with tempfile.TemporaryDirectory() as tmp:
        if args.quick and args.model is None:
            from worker.model.tiny_families import make_servable_checkpoint

            model_path = make_servable_checkpoint(Path(tmp) / "tiny", "qwen3")
        else:
            model_path = resolve_model_path(args.model)
        report: dict = {"model": str(model_path), "threads": torch.get_num_threads()}
        report["load_before"] = load_average()
        llms = engines(
            model_path,
            lm_head=args.lm_head,
            max_num_batched_tokens=1024,
            int4_group=args.int4_group_size,
        )
        report["lm_head"] = args.lm_head or "as loaded"
        report["int4_group_size"] = args.int4_group_size or "on-load default"
        report["decode_weight_bytes"] = {
            k: llm.engine.model.decode_weight_bytes for k, llm in llms.items()
        }
        vocab = llms["bf16"].engine.config.vocab_size
        prompt = fixed_lengths(1, prompt_len=16, output_len=1, vocab=vocab)[0].prompt_token_ids
        tokens = 16 if args.quick else args.decode_tokens
        decode_rates(llms, prompt, 4, 1)  # warm every engine's kernels
        report["decode"] = decode_rates(llms, prompt, tokens, args.repeats)
        print("decode", report["decode"], flush=True)
        if not args.no_w1:
            size = (8, 32) if args.quick else (32, 128)
            w1 = fixed_lengths(size[0], prompt_len=size[1], output_len=size[1], vocab=vocab)
            report["w1"] = w1_rates(llms, w1, 1 if args.quick else 2)
            print("w1", report["w1"], flush=True)
        if not args.no_quality:
            prompts = chat_prompts(llms["bf16"])[: 4 if args.quick else None]
            answer = 8 if args.quick else args.answer_tokens
            report["quality"] = quality(llms, prompts, answer)
            print("quality", report["quality"], flush=True)
        report["load_after"] = load_average()
        return write_report(report, args.out)


if __name__ == "__main__":
    main()
