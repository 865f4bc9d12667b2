"""Checks shared by the speculative-decoding engine tests: outputs against plain decoding's,
and the exact law of plain sampling for a few tokens, to test sampled outputs against."""

from __future__ import annotations

import math

import pytest
import torch

from factories import load_hf_model


def assert_same_tokens_and_logprobs(outputs, expected) -> None:
    """Speculative outputs against plain decoding's: the same tokens, logprobs and top."""
    for out, exp in zip(outputs, expected, strict=True):
        assert out.token_ids == exp.token_ids
        for got, want in zip(out.logprobs, exp.logprobs, strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in got.top_logprobs] == [t for t, _ in want.top_logprobs]


def exact_joint(target, prompt, *, temperature, top_k, repetition_penalty):
    """P(t1, t2, t3) of plain sampling, from transformers' logits processed by hand."""
    model = load_hf_model(target)

    def dist(tokens):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].double()
        seen = torch.tensor(sorted(set(tokens)))
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / repetition_penalty, values * repetition_penalty
        )
        logits = logits / temperature
        kth = logits.topk(top_k).values[-1]
        logits[logits < kth] = -torch.inf
        return logits.softmax(-1)

    joint = {}
    p1 = dist(prompt)
    for a in p1.nonzero().flatten().tolist():
        p2 = dist([*prompt, a])
        for b in p2.nonzero().flatten().tolist():
            p3 = dist([*prompt, a, b])
            for c in p3.nonzero().flatten().tolist():
                joint[(a, b, c)] = (p1[a] * p2[b] * p3[c]).item()
    return joint


def assert_follows_law(counts: dict, law: dict, *, p_value: float = 1e-4) -> None:
    """Pearson's chi-square test of observed outcome counts against an exact law.

    Outcomes the law expects fewer than 5 times are pooled into one bin, as the test asks;
    an outcome the law gives no mass fails at once. The critical value is Wilson and
    Hilferty's cube-root approximation of the chi-square quantile (scipy is not a
    dependency), within a few percent of the exact one from 3 degrees of freedom.
    """
    num = sum(counts.values())
    impossible = {x: n for x, n in counts.items() if law.get(x, 0.0) == 0.0}
    assert not impossible, f"outcomes the law rules out: {impossible}"
    bins, pooled_expected, pooled_observed = [], 0.0, 0
    for x, p in law.items():
        if p * num >= 5:
            bins.append((counts.get(x, 0), p * num))
        else:
            pooled_expected += p * num
            pooled_observed += counts.get(x, 0)
    if pooled_expected > 0:
        bins.append((pooled_observed, pooled_expected))
    statistic = sum((observed - expected) ** 2 / expected for observed, expected in bins)
    df = len(bins) - 1
    z = NORMAL_QUANTILES[p_value]
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert statistic < critical, (statistic, critical, df)


# Upper-tail standard normal quantiles for the p-values assert_follows_law takes.
NORMAL_QUANTILES = {1e-3: 3.0902, 1e-4: 3.7190}
