"""Checks shared by the speculative-decoding engine tests: outputs against plain decoding's,
and the exact law of plain sampling for a few tokens, to test sampled outputs against."""

from __future__ import annotations

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
