"""How faithful a bf16 engine's logits are: the engine as it is (the output layer's fp32 sums
kept through the sampler and logprobs) against the same engine with those logits rounded to
bf16 once (what the output layer returned before; ``RoundedHead``), both in one process.

- ``greedy``: over a fixed set of chat prompts (the chat template, greedy, ``--tokens``
  tokens), how many streams equal the fp32-logit reference's (transformers running the same
  bf16 weights, its final-norm output times the output layer in fp32), how many of their
  first tokens do, and how many tokens agree before the first difference; and how many greedy
  steps had an exact tie between the two best tokens.
- ``neighbours``: each prompt alone, then beside ``--neighbours`` busy requests (random
  prompts sampling at temperature 1): how many greedy streams change.
- ``decode``: batch-1 and batch-8 decode step time (median and best), each head alternately
  (``--repeats``); ``head_ms``: the output layer alone, best of 200, each way.
- ``france``: the answer to "What is the capital of France?" (chat template, greedy).
- ``prompt_logprobs``: each prompt token's logprob (echo) against transformers in fp32: the
  mean, median, 90th percentile and largest distance of ours, of transformers in bf16, and of
  the reference above, over the chat prompts (which share the chat template's first tokens, so
  one rounding of the first token's massive activation weighs on all of them) and over
  ``TEXTS``, plain texts that begin differently.

Usage: ``python -m bench.logit_fidelity [--model DIR] [--tokens 32] [--neighbours 7]
[--repeats 3] [--prompt-logprobs-only] [--out bench/results/logit_fidelity.json]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.report import write_report

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Explain photosynthesis in one sentence.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into Spanish.",
    "What does a bee make?",
    "List two planets in our solar system.",
    "Why is the sky blue?",
    "Suggest a name for a pet cat.",
    "What is the largest ocean on Earth?",
    "How do I make a cup of tea?",
]
FRANCE = PROMPTS[0]
TEXTS = [  # prompt logprobs only, without the chat template
    *PROMPTS,
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "In 1492, Columbus sailed across the Atlantic Ocean looking for a new route to Asia.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)",
    "Photosynthesis converts light energy into chemical energy stored in glucose molecules.",
    "Once upon a time, in a small village at the edge of a great forest, there lived a clockmaker.",
    "The mitochondria is often called the powerhouse of the cell because it produces ATP.",
    "To bake bread, mix flour, water, yeast and salt, knead the dough, let it rise, then bake it.",
    "Water boils at 100 degrees Celsius at sea level, but at lower temperatures on high mountains.",
]


class RoundedHead:
    """The output layer with its fp32 sums rounded to bf16 once, then widened: what a bf16
    kernel that rounds its output returned before logits were kept in fp32."""

    def __init__(self, head) -> None:
        self.head = head

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x).to(torch.bfloat16).float()


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )


@torch.no_grad()
def reference_greedy(model, prompt: list[int], tokens: int, eos: int | None) -> list[int]:
    """transformers' bf16 forward pass, its final-norm output times lm_head in fp32, greedy."""
    from transformers import DynamicCache

    head = model.lm_head.weight.float()
    cache = DynamicCache(config=model.config)
    ids, out = torch.tensor([prompt]), []
    for _ in range(tokens):
        hidden = model.model(ids, cache=cache, use_cache=True).last_hidden_state[0, -1]
        token = int(torch.argmax(hidden.float() @ head.T))
        out.append(token)
        if token == eos:
            break
        ids = torch.tensor([[token]])
    return out


def greedy_params(tokens: int, logprobs: int | None = None):
    from worker import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=logprobs)


def agreement(ours: list[list[int]], ref: list[list[int]]) -> dict:
    prefix = []
    for a, b in zip(ours, ref, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix.append(n)
    return {
        "streams_equal": sum(a == b for a, b in zip(ours, ref, strict=True)),
        "first_tokens_equal": sum(a[:1] == b[:1] for a, b in zip(ours, ref, strict=True)),
        "mean_tokens_before_difference": statistics.mean(prefix),
        "streams": len(ours),
    }


def greedy_run(llm, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], int]:
    """Each prompt's greedy tokens (all in one batch) and the steps whose two best tied."""
    outs = llm.generate(prompts, greedy_params(tokens, logprobs=2))
    ties = sum(
        1
        for o in outs
        for t in o.logprobs
        if len(t.top_logprobs) > 1 and t.top_logprobs[0][1] == t.top_logprobs[1][1]
    )
    return [o.token_ids for o in outs], ties


def neighbour_flips(llm, prompts: list[list[int]], tokens: int, neighbours: int) -> int:
    """Streams whose greedy tokens change when run beside busy neighbours."""
    from worker import SamplingParams

    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.config.vocab_size
    flips = 0
    for i, prompt in enumerate(prompts):
        alone = llm.generate([prompt], greedy_params(tokens))[0].token_ids
        others = [
            torch.randint(3, vocab, (int(torch.randint(8, 200, (1,), generator=g)),)).tolist()
            for _ in range(neighbours)
        ]
        busy = SamplingParams(temperature=1.0, max_tokens=tokens * 2, seed=i, ignore_eos=True)
        outs = llm.generate([prompt, *others], [greedy_params(tokens)] + [busy] * neighbours)
        flips += outs[0].token_ids != alone
    return flips


def decode_seconds(llm, prompt: list[int], batch: int, tokens: int = 48) -> float:
    """Median wall time of a decode step of ``batch`` sequences after their prefill."""
    from worker import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for j in range(batch):
        engine.add_request(f"d{time.monotonic_ns()}-{j}", [*prompt, j + 3], params)
    times = []
    while engine.has_unfinished_requests:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


@torch.inference_mode()
def head_seconds(head, hidden: int, rows: int, rounds: int = 200) -> float:
    """The best time of one output-layer product of ``rows`` bf16 rows (the kernel alone, so
    that a busy machine's noise stays out: a decode step moves by more than the head costs)."""
    x = torch.randn(rows, hidden).bfloat16()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        head(x)
        best = min(best, time.perf_counter() - start)
    return best


@torch.no_grad()
def hf_prompt_logprobs(model, ids: list[int], *, fp32_head: bool = False) -> torch.Tensor:
    """log p(t_{i+1} | t_0..t_i) for i < P - 1 from transformers (``fp32_head``: its final-norm
    output times lm_head in fp32, else its own logits)."""
    x = torch.tensor([ids])
    if fp32_head:
        hidden = model.model(x).last_hidden_state[0].float()
        logits = hidden @ model.lm_head.weight.float().T
    else:
        logits = model(x).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def engine_prompt_logprobs(llm, prompts: list[list[int]]) -> list[torch.Tensor]:
    from worker import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    return [torch.tensor([t.logprob for t in o.prompt_logprobs]) for o in outs]


def distances(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    d = torch.cat([(a.double() - b.double()).abs() for a, b in zip(ours, ref, strict=True)])
    figures = {"mean": d.mean(), "median": d.median(), "p90": d.quantile(0.9), "max": d.max()}
    return {name: round(float(v), 4) for name, v in figures.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: SmolLM2-135M)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--neighbours", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results/logit_fidelity.json")
    parser.add_argument(
        "--prompt-logprobs-only",
        action="store_true",
        help="only the prompt logprobs' distances (a minute, not the greedy runs' many)",
    )
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from worker import LLM
    from worker.model.default_model import resolve_model_path

    path = resolve_model_path(args.model)
    llm = LLM(path, dtype="bfloat16", kv_cache_memory_gb=0.5)
    model = llm.engine.model
    heads = {"fp32_logits": model.lm_head, "bf16_logits": RoundedHead(model.lm_head)}
    tokenizer = llm.tokenizer
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    eos = tokenizer.eos_token_id

    # transformers on one thread: its small matmuls on two threads of a busy 2-core machine
    # spend seconds a step in OpenMP's barriers
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ref = (
        []
        if args.prompt_logprobs_only
        else [reference_greedy(hf, p, args.tokens, eos) for p in prompts]
    )
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    texts = [tokenizer(t)["input_ids"] for t in TEXTS]
    exact = {"chat": [hf_prompt_logprobs(hf32, p) for p in prompts]}
    exact["texts"] = [hf_prompt_logprobs(hf32, p) for p in texts]
    scored = {"chat": prompts, "texts": texts}

    def theirs(fp32_head: bool) -> dict:
        return {
            kind: distances(
                [hf_prompt_logprobs(hf, p, fp32_head=fp32_head) for p in ids], exact[kind]
            )
            for kind, ids in scored.items()
        }

    report: dict = {
        "model": str(path),
        "prompts": len(prompts),
        "tokens": args.tokens,
        "prompt_logprobs": {
            "transformers_bf16": theirs(False),
            "reference_bf16_fp32_head": theirs(True),
        },
    }
    del hf32
    torch.set_num_threads(threads)
    if args.prompt_logprobs_only:
        report["prompt_logprobs"]["ours"] = {
            kind: distances(engine_prompt_logprobs(llm, ids), exact[kind])
            for kind, ids in scored.items()
        }
        print(report)
        return write_report(report, args.out)
    report["reference_france"] = tokenizer.decode(ref[0])
    print(report)

    decode: dict[str, dict[int, list[float]]] = {name: {1: [], 8: []} for name in heads}
    for name, head in heads.items():
        model.lm_head = head
        tokens, ties = greedy_run(llm, prompts, args.tokens)
        france = llm.generate([prompts[0]], greedy_params(args.tokens))[0].text
        report[name] = {
            "greedy": agreement(tokens, ref) | {"exact_ties": ties},
            "neighbour_flips": neighbour_flips(llm, prompts, args.tokens, args.neighbours),
            "france": france,
            "prompt_logprobs": {
                kind: distances(engine_prompt_logprobs(llm, ids), exact[kind])
                for kind, ids in scored.items()
            },
        }
        print(name, report[name])
    for _ in range(args.repeats):  # alternately, so a busy machine slows both alike
        for name, head in heads.items():
            model.lm_head = head
            for batch in decode[name]:
                decode[name][batch].append(decode_seconds(llm, prompts[1], batch))
    model.lm_head = heads["fp32_logits"]
    for name in heads:
        report[name]["decode_step_ms"] = {
            b: {"median": round(1000 * statistics.median(s), 2), "best": round(1000 * min(s), 2)}
            for b, s in decode[name].items()
        }
    report["decode_cost_fp32_over_bf16"] = {
        b: {
            "median": round(statistics.median(decode["fp32_logits"][b]) / statistics.median(s), 3),
            "best": round(min(decode["fp32_logits"][b]) / min(s), 3),
        }
        for b, s in decode["bf16_logits"].items()
    }
    hidden = model.config.hidden_size
    report["head_ms"] = {  # alternately, best of each
        name: {rows: round(1000 * head_seconds(head, hidden, rows), 3) for rows in (1, 8)}
        for name, head in heads.items()
    }

    print(report)
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
