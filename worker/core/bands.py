"""How much batch work a step may carry beside interactive work.

Batch work (the Batch API's lines) fills what interactive work leaves. On an accelerator a
decode step of a few rows leaves most of the machine idle, so batch rows beside it cost the
interactive rows little; on a CPU each row costs time. Either way the rule is the same, read
from what steps cost on this machine (``worker.core.step_budget.StepTimes``): while a step
carries interactive work, batch work may add only the tokens that keep the step within
``BATCH_SLOWDOWN`` of the interactive work's own time; where that work is decodes alone, batch
decode rows only, priced on the times of steps of decodes alone (``batch_rows_beside_decodes``).
The rest of the batch work waits (its decodes take turns), holding its KV blocks: under steady
interactive traffic batch prompts start only between its requests. With no interactive work
every batch decode runs and the lines' prompt chunks fill the step up to ``BATCH_STEP_S`` (at
least ``MIN_PREFILL_TOKENS``); an interactive arrival stops such a step at its next layer
(``worker.model.step_interrupt``), and the bound is what a step dropped that way may waste.
"""

from __future__ import annotations

from worker.core.step_budget import DecodeStepBudget, StepTimes

# The most a step carrying interactive work may be slowed by the batch work beside it.
BATCH_SLOWDOWN = 0.10
# The longest a step of batch work alone may take (what an interactive arrival may make it
# drop: it stops at the arrival's next layer and is run again).
BATCH_STEP_S = 0.25


def batch_token_room(
    times: StepTimes, interactive_tokens: int, *, slowdown: float = BATCH_SLOWDOWN
) -> int | None:
    """Tokens of batch work a step of ``interactive_tokens`` may add (none: within
    ``BATCH_STEP_S``); None when nothing is known of step times (no bound)."""
    if interactive_tokens < 1:
        within = times.max_tokens_within(BATCH_STEP_S)
        return None if within is None else max(1, within)
    alone = times.seconds(interactive_tokens)
    if alone is None:
        return None
    within = times.max_tokens_within(alone * (1 + slowdown))
    if within is None:
        return None
    return max(0, within - interactive_tokens)


def batch_rows_beside_decodes(
    budget: DecodeStepBudget, rows: int, *, slowdown: float = BATCH_SLOWDOWN
) -> int | None:
    """Batch decode rows a step of ``rows`` interactive decodes alone may add and stay within
    ``slowdown`` of those rows' own time on ``budget.decode_times``; None while that curve
    knows nothing (``batch_token_room`` then rules). No batch prompt chunk joins such a step:
    it would make it a step of another kind (on a CPU the native decode step takes decodes
    alone: two rows of the default model 6 ms on a Zen 4, 11-14 ms with one prompt token
    beside them; on a GPU, a CUDA graph)."""
    decodes = budget.decode_times
    alone = decodes.seconds(rows)
    if alone is None:
        return None
    return max(0, (decodes.max_tokens_within(alone * (1 + slowdown)) or 0) - rows)
