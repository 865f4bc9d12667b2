"""What verifying draft positions costs on this machine, measured once at start.

Drafts pay when the tokens they are expected to add outweigh the time their verification
rows add. That time depends on the hardware far more than on the model, and is not linear
in the rows: a memory-bound CPU with native bf16 verifies a few rows almost for free, a
CPU whose matmuls are compute-bound pays for each from the first, a GPU next to nothing
(figures: docs/performance.md). It also depends on the batch and the context: each
verified row attends its sequence's whole context, so a row beside cached chats costs
several times one of a fresh prefill, and timing the latter misprices drafts. So
the engine times decode steps as they run, before it serves: B sequences with a cached
context each feed their token and n draft rows, for B = 1, 2, 4, ... and n = 0, 1, 2, 4,
...; the back-off policy reads the cost of drafts off that table.
"""

from __future__ import annotations

import bisect
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.core.batch import ScheduledSequence
from worker.core.block_manager import BlockManager
from worker.core.sequence import Sequence

logger = logging.getLogger(__name__)

MEASURE_REPEATS = 3  # per point; the fastest counts (noise only ever slows a run down)
# Tokens each timed sequence has cached: a chat turn's context (a longer one makes rows
# dearer, a shorter one cheaper).
CONTEXT = 256
MAX_MEASURED_DRAFTS = 32  # rows per sequence timed at most; more are extrapolated
# The engine's own decode steps (LiveStepCosts): the latest kept per size, and how many
# before their median replaces the start-up figure.
OBSERVED_WINDOW = 32
MIN_OBSERVATIONS = 4


def _interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise linear through the points, the end segments' slopes past them."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True, slots=True)
class StepCostTable:
    """Seconds of a decode step by decoding sequences and draft rows fed per sequence:
    ``seconds[i][j]`` for ``batches[i]`` sequences feeding ``drafts[i][j]`` drafts each."""

    batches: tuple[int, ...]
    drafts: tuple[tuple[int, ...], ...]
    seconds: tuple[tuple[float, ...], ...]

    def time(self, num_decodes: float, num_drafts: float) -> float:
        """Along the drafts at each measured batch size, then along the batch sizes."""
        by_batch = tuple(
            _interpolate(tuple(map(float, d)), s, num_drafts)
            for d, s in zip(self.drafts, self.seconds, strict=True)
        )
        return max(_interpolate(tuple(map(float, self.batches)), by_batch, num_decodes), 1e-9)

    def verify_cost(self, num_decodes: int, num_drafts: float) -> float:
        """What ``num_drafts`` verified rows per sequence add to a step of ``num_decodes``
        sequences, in units of the plain step: (T(B, n) - T(B, 0)) / T(B, 0)."""
        b = max(1, num_decodes)
        plain = self.time(b, 0)
        return max(self.time(b, num_drafts) - plain, 0.0) / plain

    def describe(self) -> str:
        return "; ".join(
            f"{b} seqs: " + ", ".join(f"+{n} {1000 * t:.1f} ms" for n, t in zip(d, s, strict=True))
            for b, d, s in zip(self.batches, self.drafts, self.seconds, strict=True)
        )


class LiveStepCosts:
    """The start-up table, corrected by the decode steps the engine runs (each timed, the
    speculator reports them: ``observe``). A point timed three times at start can be far
    off on a shared machine, and a plan that believes rows cheaper than they are verifies
    alternatives that do not repay them (docs/performance.md). Where enough steps of one
    size ran (``MIN_OBSERVATIONS``; decoding sequences and draft rows in all), the median
    of the latest ``OBSERVED_WINDOW`` replaces the table's figure (those figures made
    non-decreasing in rows); the table's other points are scaled by how far the machine
    moved (at the fewest rows observed) and kept between the observed figures around them,
    so more rows never cost less."""

    def __init__(
        self,
        table: StepCostTable,
        *,
        window: int = OBSERVED_WINDOW,
        min_observations: int = MIN_OBSERVATIONS,
    ) -> None:
        self.table = table
        self.window = window
        self.min_observations = min_observations
        self._samples: dict[tuple[int, int], deque[float]] = {}
        # Per batch size: the merged curve, (rows in all, seconds), rebuilt when it changes.
        self._curves: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = {}

    def observe(self, num_decodes: int, rows: int, seconds: float) -> None:
        """A decode step of ``num_decodes`` sequences feeding ``rows`` draft rows in all."""
        if num_decodes < 1 or rows < 0 or not seconds > 0:
            return
        key = (num_decodes, rows)
        samples = self._samples.get(key)
        if samples is None:
            samples = self._samples[key] = deque(maxlen=self.window)
        samples.append(seconds)
        if len(samples) >= self.min_observations:
            self._curves.pop(num_decodes, None)

    def time(self, num_decodes: int, num_drafts: float) -> float:
        """Seconds of a step of ``num_decodes`` sequences feeding ``num_drafts`` each."""
        xs, ys = self._curve(max(1, num_decodes))
        return max(_interpolate(xs, ys, num_drafts * max(1, num_decodes)), 1e-9)

    def verify_cost(self, num_decodes: int, num_drafts: float) -> float:
        """As ``StepCostTable.verify_cost``, from the corrected figures."""
        plain = self.time(num_decodes, 0)
        return max(self.time(num_decodes, num_drafts) - plain, 0.0) / plain

    def _curve(self, batch: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        curve = self._curves.get(batch)
        if curve is not None:
            return curve
        nearest = min(self.table.batches, key=lambda b: abs(b - batch))
        drafts = self.table.drafts[self.table.batches.index(nearest)]
        points = {float(batch * d): self.table.time(batch, d) for d in drafts}
        observed = sorted(
            (float(rows), statistics.median(samples))
            for (b, rows), samples in self._samples.items()
            if b == batch and len(samples) >= self.min_observations
        )
        obs_xs = [x for x, _ in observed]
        obs_ys = _monotone([y for _, y in observed])
        # How far the machine moved since the table: at the fewest rows observed, the
        # figure least touched by the table's errors about rows.
        scale = obs_ys[0] / self.table.time(batch, obs_xs[0] / batch) if observed else 1.0
        merged = dict(zip(obs_xs, obs_ys, strict=True))
        for x, t in points.items():
            if x not in merged:  # the table's, between the observed figures around it
                i = bisect.bisect_left(obs_xs, x)
                low = obs_ys[i - 1] if i else 0.0
                high = obs_ys[i] if i < len(obs_ys) else float("inf")
                merged[x] = min(max(t * scale, low), high)
        xs = tuple(sorted(merged))
        curve = (xs, tuple(merged[x] for x in xs))
        self._curves[batch] = curve
        return curve


def _powers_of_two_to(limit: int, *, start: int) -> list[int]:
    values, v = [], start
    while v < limit:
        values.append(v)
        v = max(1, 2 * v)
    return [*values, limit] if limit >= start else values


def measure_step_costs(
    execute: Callable[[list[ScheduledSequence]], object],
    block_manager: BlockManager,
    *,
    max_batch: int,
    max_drafts: int,
    row_limit: int,
    max_model_len: int,
    vocab_size: int,
    device: torch.device,
    context: int = CONTEXT,
) -> StepCostTable:
    """Times ``execute`` (the model runner's forward pass) on scratch decode steps: up to
    ``max_batch`` sequences sharing one cached context (its blocks forked, so it is
    prefilled once), each feeding its token and up to ``max_drafts`` drafts, within the
    step's ``row_limit``; every block is returned to the pool afterwards."""
    bs = block_manager.block_size
    max_drafts = max(1, min(max_drafts, MAX_MEASURED_DRAFTS, row_limit - 1))
    context = min(context, max_model_len - max_drafts - 1) // bs * bs
    batches = _powers_of_two_to(max(1, max_batch), start=1)
    tail_blocks = -(-(max_drafts + 1 + bs) // bs)
    # A small pool (tests) times a shorter context, and fewer sequences if it must.
    while context and not block_manager.can_allocate([], context + batches[-1] * tail_blocks * bs):
        context = context // 2 // bs * bs
    while len(batches) > 1 and not block_manager.can_allocate(
        [], context + batches[-1] * tail_blocks * bs
    ):
        batches.pop()
    tokens = [i % max(vocab_size, 1) for i in range(context + 1)]
    base = Sequence("step-cost", tokens[:context], None, 0)
    seqs: list[Sequence] = []
    try:
        block_manager.allocate(base.block_table, context)
        for start in range(0, context, max(1, row_limit)):
            execute([ScheduledSequence(base, start, min(row_limit, context - start))])
        while len(seqs) < batches[-1]:
            seq = Sequence(f"step-cost-{len(seqs)}", tokens, None, 0)
            seq.block_table = block_manager.fork(base.block_table)
            block_manager.allocate(seq.block_table, context + 1 + max_drafts)
            seq.num_computed_tokens = context
            seqs.append(seq)
        points = []  # (batch, drafts)
        drafts_by_batch = []
        for batch in batches:
            limit = min(max_drafts, row_limit // batch - 1)
            counts = [0, *_powers_of_two_to(limit, start=1)] if limit >= 1 else [0]
            drafts_by_batch.append(tuple(counts))
            points += [(batch, n) for n in counts]
        # Rounds over every point, the fastest of each kept: a hiccup of the machine spoils
        # one point of one round, not a point (the first round warms up and is dropped).
        best = {p: float("inf") for p in points}
        for round_ in range(MEASURE_REPEATS + 1):
            for batch, n in points:
                seconds = _time_step(execute, seqs[:batch], n, context, device)
                if round_:
                    best[batch, n] = min(best[batch, n], seconds)
        seconds_by_batch = [
            _monotone([best[b, n] for n in counts])
            for b, counts in zip(batches, drafts_by_batch, strict=True)
        ]
    finally:
        for seq in seqs:
            block_manager.free(seq.block_table)
        block_manager.free(base.block_table)
    table = StepCostTable(tuple(batches), tuple(drafts_by_batch), tuple(seconds_by_batch))
    logger.info("speculation cost model: decode step by drafts fed: %s", table.describe())
    return table


def _time_step(execute, seqs: list[Sequence], drafts: int, context: int, device) -> float:
    """One step of ``seqs`` each feeding its token at ``context`` and ``drafts`` draft rows."""
    for seq in seqs:
        seq.spec_token_ids = [seq.tokens[-1]] * drafts
    step = [ScheduledSequence(seq, context, 1, drafts) for seq in seqs]
    start = time.perf_counter()
    execute(step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    for seq in seqs:
        seq.clear_spec()
    return seconds


def _monotone(values: list[float]) -> tuple[float, ...]:
    """The closest non-decreasing sequence (least squares: pool adjacent violators): more
    rows never cost less, and timing noise should not say they do."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return tuple(m for m, c in blocks for _ in range(int(c)))
