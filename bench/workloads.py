"""Seeded synthetic workloads for the benchmarks: token-id prompts with realistic lengths."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def fixed_lengths(
    num: int, *, prompt_len: int, output_len: int, vocab: int, seed: int = 0
) -> list[BenchRequest]:
    """W1-style: every request has the same prompt and output length."""
    rng = np.random.default_rng(seed)
    return [BenchRequest(random_tokens(rng, prompt_len, vocab), output_len) for _ in range(num)]


def long_tailed(
    num: int,
    *,
    vocab: int,
    prompt_range: tuple[int, int] = (16, 1024),
    output_range: tuple[int, int] = (8, 512),
    seed: int = 0,
) -> list[BenchRequest]:
    """W2-style chat traffic: log-normal prompt and output lengths, clipped to the ranges.

    Medians (~200 prompt, ~120 output tokens) and spreads resemble public chat traces
    (ShareGPT-like): most requests are short, a few are long.
    """
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(200), 0.9, num), *prompt_range).astype(int)
    outputs = np.clip(rng.lognormal(np.log(120), 0.9, num), *output_range).astype(int)
    return [
        BenchRequest(random_tokens(rng, int(p), vocab), int(o))
        for p, o in zip(prompts, outputs, strict=True)
    ]


def random_tokens(rng: np.random.Generator, length: int, vocab: int) -> list[int]:
    # Skip the lowest ids, where tokenizers keep their special tokens.
    return rng.integers(100, vocab, length).tolist()
