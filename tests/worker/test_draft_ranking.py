"""The draft's ranking of a pass (draft_ranking.rank_rows) against torch over the full
vocabulary, computed here by hand: the batched path of greedy rows over the draft's kept
columns, and the one-row path of penalized and sampled rows, mixed in one pass."""

from __future__ import annotations

import math

import pytest
import torch

from worker.sampling.rows import SamplingRow, make_generator
from worker.sampling.sampling_params import SamplingParams
from worker.spec_decode.draft_ranking import rank_rows

VOCAB, KEPT = 100, 40
COUNT, MIN_PROB = 3, 0.02


def reference(full: torch.Tensor, *, temperature: float = 0.0):
    """Token ids by falling probability, and the log-probabilities, under softmax(full / T)
    (T = 1 for greedy)."""
    logp = torch.log_softmax(full / (temperature or 1.0), dim=-1).double()
    order = torch.argsort(logp, descending=True).tolist()
    return order, logp


def test_greedy_and_penalized_and_sampled_rows_ranked_as_over_the_full_vocabulary():
    torch.manual_seed(0)
    columns = torch.randperm(VOCAB)[:KEPT].sort().values
    logits = torch.randn(4, KEPT) * 3
    full = torch.full((4, VOCAB), float("-inf"))
    full[:, columns] = logits

    def full_logits(kept: torch.Tensor) -> torch.Tensor:
        out = torch.full((kept.shape[0], VOCAB), float("-inf"))
        out[:, columns] = kept
        return out

    greedy = SamplingParams(temperature=0.0)
    penalized = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    sampled = SamplingParams(temperature=0.7, seed=5)
    prompt = [int(columns[0]), int(columns[1])]
    drafts_before = [int(columns[2])]
    rows = [
        SamplingRow(greedy, [], prompt, None),
        SamplingRow(penalized, [], prompt, None),
        SamplingRow(sampled, [], prompt, make_generator(5)),
        SamplingRow(greedy, [], prompt, None),
    ]
    contexts = [[], drafts_before, [], []]
    ranked = rank_rows(logits, columns, full_logits, rows, contexts, count=COUNT, min_prob=MIN_PROB)
    assert len(ranked) == 4

    # Greedy rows: the argmax, and the next ones of at least MIN_PROB.
    for j in (0, 3):
        order, logp = reference(full[j])
        assert ranked[j].token == order[0]
        assert ranked[j].prob == pytest.approx(math.exp(logp[order[0]]), rel=1e-5)
        want = [t for t in order[1 : COUNT + 1] if math.exp(logp[t]) >= MIN_PROB]
        assert ranked[j].alternatives == want
        assert ranked[j].alternative_probs == pytest.approx(
            [math.exp(logp[t]) for t in want], rel=1e-5
        )
        assert ranked[j].distribution is None

    # The penalized row: repetition penalty over prompt, output and the drafts before it
    # (positive logits divided, negative multiplied), then as a greedy row.
    x = full[1].clone()
    for t in {*prompt, *drafts_before}:
        x[t] = x[t] / 2.0 if x[t] > 0 else x[t] * 2.0
    order, logp = reference(x)
    assert ranked[1].token == order[0]
    assert ranked[1].prob == pytest.approx(math.exp(logp[order[0]]), rel=1e-5)
    assert ranked[1].alternatives == [
        t for t in order[1 : COUNT + 1] if math.exp(logp[t]) >= MIN_PROB
    ]

    # The sampled row: its distribution is softmax(x / T), its token one of the kept
    # columns, ranked by that distribution.
    order, logp = reference(full[2], temperature=0.7)
    assert ranked[2].distribution is not None
    assert ranked[2].distribution.double() == pytest.approx(logp.exp(), abs=1e-6)
    assert ranked[2].token in columns.tolist()
    assert ranked[2].prob == pytest.approx(math.exp(logp[ranked[2].token]), rel=1e-5)
    assert ranked[2].token not in ranked[2].alternatives
    assert all(
        logp[a] <= logp[b]
        for a, b in zip(ranked[2].alternatives[1:], ranked[2].alternatives[:-1], strict=True)
    )
