"""The distribution a request samples from at each speculated position, from raw logits.

Target and draft go through the same processing as the sampler (``worker.sampling.sampler``):
penalties over prompt + output, where the output at position j includes the drafts before
it; greedy rows stop there (argmax); others apply temperature, then top-k / top-p / min-p
(``filter_logits``, the sampler's specification), then softmax.
"""

from __future__ import annotations

import torch

from worker.sampling.penalties import apply_penalties_
from worker.sampling.rows import SamplingRow
from worker.sampling.sampler import GREEDY_TEMPERATURE, filter_logits
from worker.spec_decode.rejection_sampler import draw


def is_greedy(row: SamplingRow) -> bool:
    return row.params.temperature < GREEDY_TEMPERATURE


def position_rows(row: SamplingRow, drafts: list[int]) -> list[SamplingRow]:
    """One row per position 0..len(drafts): the request as if drafts[:j] were generated."""
    if not row.params.has_penalties:
        return [row] * (len(drafts) + 1)
    return [
        SamplingRow(row.params, row.output_token_ids + drafts[:j], row.prompt_token_ids, None)
        for j in range(len(drafts) + 1)
    ]


def processed_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Penalized fp32 copy of ``logits`` [m, vocab], one row per position."""
    x = logits.to(torch.float32, copy=True).contiguous()
    params = rows[0].params
    if params.has_penalties:
        apply_penalties_(
            x,
            prompt_token_ids=[r.prompt_token_ids for r in rows],
            output_token_ids=[r.output_token_ids for r in rows],
            repetition_penalty=[params.repetition_penalty] * len(rows),
            presence_penalty=[params.presence_penalty] * len(rows),
            frequency_penalty=[params.frequency_penalty] * len(rows),
            logit_bias=[params.logit_bias] * len(rows),
        )
    return x


def probabilities(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Sampling distribution of non-greedy rows: x [m, vocab] penalized logits -> probs."""
    params = rows[0].params
    if params.temperature != 1.0:
        x = x / params.temperature
    m = x.shape[0]
    if params.top_k or params.top_p < 1.0 or params.min_p > 0.0:
        x = filter_logits(
            x, top_k=[params.top_k] * m, top_p=[params.top_p] * m, min_p=[params.min_p] * m
        )
    return torch.softmax(x, dim=-1)


def argmax(x: torch.Tensor) -> list[int]:
    """Row argmax, first index on ties (as the sampler's greedy path)."""
    return x.numpy().argmax(axis=-1).tolist() if x.device.type == "cpu" else x.argmax(-1).tolist()


def next_token(
    logits: torch.Tensor, row: SamplingRow, context: list[int]
) -> tuple[int, torch.Tensor | None, torch.Tensor]:
    """The request's token after ``context`` (tokens past its output so far) from one row
    of raw logits [vocab]: (token, its distribution or None for greedy, the processed
    logits [vocab])."""
    rows = position_rows(row, context)[-1:]
    x = processed_logits(logits[None], rows)
    if is_greedy(row):
        return argmax(x)[0], None, x[0]
    p = probabilities(x, rows)  # [1, vocab]
    u = torch.rand(1, dtype=torch.float64, generator=row.generator)
    return int(draw(p, u)[0]), p[0], x[0]
