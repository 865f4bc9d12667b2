"""Fault isolation in a step: when the batch fails, find the sequences that make it fail.

A request's values can fail only that request. The forward pass is bisected (a sequence's
logits and K/V depend only on its own tokens, so running parts of a batch apart writes the
same slots with the same values and gives each sequence the same rows); sampling is redone
row by row, with seeded generators rewound first so their draws are those of a clean step.
Each costs nothing until a step raises. A tensor-parallel group that fails
(``TensorParallelError``) is not a request's fault and is never isolated: it propagates, as
does a step stopped for interactive work (``StepAbandoned``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from worker.core.batch import ScheduledSequence
from worker.core.sequence import Sequence
from worker.errors import NonFiniteLogitsError, SequenceFailedError, TensorParallelError
from worker.model.step_interrupt import StepAbandoned
from worker.sampling.rows import SampledToken, SamplingRow
from worker.sampling.sampler import Sampler, why_unusable

logger = logging.getLogger(__name__)

Execute = Callable[[list[ScheduledSequence]], tuple[list[ScheduledSequence], torch.Tensor]]


@dataclass(slots=True)
class Executed:
    """A forward pass, whole or in parts: the sequences that sample and their logits rows
    (as ``ModelRunner.execute`` returns them), and the sequences that failed it alone."""

    sampling: list[ScheduledSequence]
    logits: torch.Tensor  # [rows, vocab]
    failed: dict[Sequence, SequenceFailedError] = field(default_factory=dict)
    parts: int = 1  # passes run: 1 unless the batch failed whole


def execute_isolating(execute: Execute, scheduled: list[ScheduledSequence]) -> Executed:
    """``execute(scheduled)``; if it raises, halves run apart until each failing part is one
    sequence, which fails alone. Parts keep the batch's order, so rows stay aligned."""
    try:
        sampling, logits = execute(scheduled)
        return Executed(sampling, logits)
    except (TensorParallelError, StepAbandoned):
        raise
    except Exception as exc:
        if len(scheduled) == 1:
            return _one_failed(scheduled[0].seq, exc)
        logger.warning(
            "a step of %d sequences failed (%r): running it in parts", len(scheduled), exc
        )
    parts: list[Executed] = []
    pending = [scheduled[: len(scheduled) // 2], scheduled[len(scheduled) // 2 :]]
    while pending:
        part = pending.pop(0)
        try:
            sampling, logits = execute(part)
            parts.append(Executed(sampling, logits))
        except (TensorParallelError, StepAbandoned):
            raise
        except Exception as exc:
            if len(part) == 1:
                parts.append(_one_failed(part[0].seq, exc))
            else:
                pending[:0] = [part[: len(part) // 2], part[len(part) // 2 :]]
    kept = [p.logits for p in parts if p.sampling]
    return Executed(
        sampling=[s for p in parts for s in p.sampling],
        logits=torch.cat(kept) if kept else torch.empty(0, 0),
        failed={seq: error for p in parts for seq, error in p.failed.items()},
        parts=len(parts),
    )


def _one_failed(seq: Sequence, exc: Exception) -> Executed:
    logger.error("request %s fails the forward pass alone: %r", seq.request_id, exc)
    error = SequenceFailedError(f"the forward pass failed for this request: {exc!r}")
    return Executed([], torch.empty(0, 0), {seq: error})


def sample_isolating(
    sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[list[SampledToken], dict[int, Exception]]:
    """The sampler's tokens, and the rows that failed (by index) with their error: rows the
    sampler could not sample (``SampledToken.failure``), and rows it raises for alone."""
    if not rows:
        return [], {}
    states = [(r.generator, r.generator.get_state()) for r in rows if r.generator is not None]
    try:
        tokens = sampler(logits, rows)
    except Exception as exc:
        logger.warning("sampling %d rows failed (%r): sampling them one by one", len(rows), exc)
        for generator, state in states:
            generator.set_state(state)
        tokens, raised = _one_by_one(sampler, logits, rows)
    else:
        raised = {}
    failures: dict[int, Exception] = dict(raised)
    for i, token in enumerate(tokens):
        if token.failure is not None:
            failures[i] = NonFiniteLogitsError(token.failure)
    return tokens, failures


def _one_by_one(
    sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[list[SampledToken], dict[int, Exception]]:
    tokens: list[SampledToken] = []
    raised: dict[int, Exception] = {}
    for i, row in enumerate(rows):
        try:
            tokens.extend(sampler(logits[i : i + 1], [row]))
        except Exception as exc:
            logger.error("sampling fails for one row alone: %r", exc)
            raised[i] = SequenceFailedError(f"sampling failed for this request: {exc!r}")
            tokens.append(SampledToken(0, None, None, None))
    return tokens, raised


def non_finite(seq: Sequence, why: str) -> NonFiniteLogitsError:
    """The error of a request whose own logits cannot be sampled (``why_unusable``), naming
    the adapter (or mix) it runs with: an adapter whose weights overflow the dtype is the usual
    cause. Attention reads no slot a sequence does not own, so the step's others are untouched."""
    if seq.adapter_mix is not None:
        names = ", ".join(repr(adapter_id) for adapter_id, _ in seq.adapter_mix.parts)
        return NonFiniteLogitsError(f"{why}, with the mix of adapters {names}")
    if seq.adapter_id is not None:
        return NonFiniteLogitsError(
            f"{why}, with adapter {seq.adapter_id!r}: its weights take the model's values past "
            "what the dtype holds"
        )
    return NonFiniteLogitsError(why)


def with_adapter_named(seq: Sequence, exc: Exception) -> Exception:
    """A sampling failure of ``seq``: unusable logits say which adapter gave them."""
    return non_finite(seq, str(exc)) if isinstance(exc, NonFiniteLogitsError) else exc


def plain_rows(
    sampling: list[ScheduledSequence], logits: torch.Tensor
) -> tuple[list[ScheduledSequence], torch.Tensor]:
    """The sequences that verify no drafts and their logits rows (a speculating sequence
    has ``num_spec + 1`` rows, the others one), for when verification failed."""
    plain, rows, row = [], [], 0
    for s in sampling:
        if not s.num_spec:
            plain.append(s)
            rows.append(row)
        row += s.num_spec + 1
    return plain, logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)]


def drop_unusable_drafts(
    sampling: list[ScheduledSequence], logits: torch.Tensor
) -> tuple[list[ScheduledSequence], torch.Tensor, dict[Sequence, NonFiniteLogitsError]]:
    """Speculating sequences with a NaN or all -inf logits row fail before verification
    (the sampler checks the plain rows itself); the rest and their rows go on."""
    if not any(s.num_spec for s in sampling):
        return sampling, logits, {}
    top = logits.amax(dim=-1).float().tolist()  # NaN propagates
    kept, rows, failed, row = [], [], {}, 0
    for s in sampling:
        span = range(row, row + s.num_spec + 1)
        why = next((w for r in span if (w := why_unusable(top[r])) is not None), None)
        if s.num_spec and why is not None:
            failed[s.seq] = non_finite(s.seq, why)
        else:
            kept.append(s)
            rows.extend(span)
        row = span.stop
    if not failed:
        return sampling, logits, {}
    return kept, logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)], failed
