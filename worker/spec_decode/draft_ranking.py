"""A draft model's logits -> its draft token at each row, its confidence in it, and its
runner-ups (alternatives) with theirs.

Each row is chosen as the request samples (``distributions.next_token``: penalties over
prompt, output and the drafts before it; greedy rows take the argmax, others draw from the
request's distribution), and ranked as the draft would sample. Greedy rows without
penalties, most of a chat's, are done together: one softmax and one top-k over the draft's
own output columns for the whole pass: row by row over the full vocabulary would cost a
quarter of a draft pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from worker.sampling.rows import SamplingRow
from worker.spec_decode import distributions as dist


@dataclass(slots=True)
class Ranked:
    token: int
    prob: float  # the draft's probability of ``token``
    alternatives: list[int]  # runner-ups, best first
    alternative_probs: list[float]
    # The distribution ``token`` was drawn from [vocab] (the rejection sampler's q); None
    # for a greedy row.
    distribution: torch.Tensor | None


def rank_rows(
    logits: torch.Tensor,  # [rows, columns] fp32: the output layer's columns
    columns: torch.Tensor | None,  # [columns]: the token id of each column; None: all
    full_logits,  # [rows', columns] -> [rows', vocab], -inf where no column
    rows: list[SamplingRow],
    contexts: list[list[int]],  # per row: the drafts already made before it
    *,
    count: int,
    min_prob: float,
) -> list[Ranked]:
    """Each row's draft, confidence and up to ``count`` runner-ups of at least
    ``min_prob`` probability."""
    out: list[Ranked | None] = [None] * len(rows)
    plain = [j for j, r in enumerate(rows) if dist.is_greedy(r) and not r.params.has_penalties]
    if plain:
        logp = torch.log_softmax(logits[plain], dim=-1)
        top = torch.topk(logp, min(count + 1, logp.shape[-1]), dim=-1)
        ids = top.indices if columns is None else columns[top.indices]
        floor = math.log(min_prob) if min_prob > 0 else float("-inf")
        for j, tokens, values in zip(plain, ids.tolist(), top.values.tolist(), strict=True):
            picked = [(t, v) for t, v in zip(tokens[1:], values[1:], strict=True) if v >= floor]
            out[j] = Ranked(
                tokens[0],
                math.exp(values[0]),
                [t for t, _ in picked],
                [math.exp(v) for _, v in picked],
                None,
            )
    others = [j for j in range(len(rows)) if out[j] is None]
    if others:
        full = full_logits(logits[others])
        for j, row in zip(others, full, strict=True):
            token, p, x = dist.next_token(row, rows[j], contexts[j])
            ranking = x if p is None else p.log()  # as the draft would sample
            prob, alternatives, alternative_probs = runner_ups(
                ranking, token, count=count, min_prob=min_prob
            )
            out[j] = Ranked(token, prob, alternatives, alternative_probs, p)
    return [r for r in out if r is not None]


def runner_ups(
    x: torch.Tensor, token: int, *, count: int, min_prob: float
) -> tuple[float, list[int], list[float]]:
    """The draft's probability of ``token`` under the softmax of ``x`` (logits or
    log-probabilities [vocab], its own ranking), then up to ``count`` tokens after it in
    that ranking whose probability is at least ``min_prob``, and their probabilities."""
    logp = torch.log_softmax(x, dim=-1)
    prob = float(logp[token].exp())
    if count <= 0:
        return prob, [], []
    top = torch.topk(logp, count + 1)
    floor = math.log(min_prob) if min_prob > 0 else float("-inf")
    picked = [
        (t, lp)
        for t, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        if t != token and lp >= floor
    ][:count]
    return prob, [t for t, _ in picked], [math.exp(lp) for _, lp in picked]
