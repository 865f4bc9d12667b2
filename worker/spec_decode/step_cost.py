"""What verifying draft positions costs on this machine, measured once at start.

Drafts pay when the tokens they are expected to add outweigh the time their verification
rows add. That time depends on the hardware far more than on the model, and is not linear
in the rows: on a memory-bound CPU with native bf16 a step of 5 rows cost 3% more than one
row; on a Zen 4 in bf16, 2-6 rows cost nothing extra and 17 rows 60% more; on an AVX2-only
CPU in fp32 (the matmuls compute-bound from a few rows) 5 rows cost 35% more; on a GPU next
to nothing. So the engine times forward passes of 1, 2, 4, ... rows before it serves, and
the back-off policy reads the cost of n drafts off that curve.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.block_manager import BlockManager
from worker.scheduler import ScheduledSequence
from worker.sequence import Sequence

logger = logging.getLogger(__name__)

MEASURE_REPEATS = 3  # per point; the fastest counts (noise only ever slows a run down)


@dataclass(frozen=True, slots=True)
class StepCostCurve:
    """Seconds of a forward pass by rows fed, at increasing row counts."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def time(self, rows: float) -> float:
        """Piecewise linear between the points; the last segment's slope past them."""
        i = min(max(bisect.bisect_left(self.rows, rows), 1), len(self.rows) - 1)
        r0, r1 = self.rows[i - 1], self.rows[i]
        t0, t1 = self.seconds[i - 1], self.seconds[i]
        return max(t0 + (t1 - t0) * (rows - r0) / (r1 - r0), 1e-9)

    def verify_cost(self, num_decodes: int, num_drafts: int) -> float:
        """What ``num_drafts`` verified positions per sequence add to a step of
        ``num_decodes`` sequences, per sequence, in units of the plain step's time per token
        (it yields one token each): (T(B (1 + n)) - T(B)) / T(B)."""
        b = max(1, num_decodes)
        plain = self.time(b)
        return max(self.time(b * (1 + num_drafts)) - plain, 0.0) / plain

    def describe(self) -> str:
        pairs = zip(self.rows, self.seconds, strict=True)
        return ", ".join(f"{rows}: {1000 * seconds:.1f} ms" for rows, seconds in pairs)


def measure_step_curve(
    execute: Callable[[list[ScheduledSequence]], object],
    block_manager: BlockManager,
    max_rows: int,
    *,
    row_limit: int,
    vocab_size: int,
    device: torch.device,
) -> StepCostCurve:
    """Times ``execute`` (the model runner's forward pass) on one scratch sequence feeding
    1, 2, 4, ... up to ``max_rows`` tokens (at most ``row_limit``: the step's token budget,
    the context length), its blocks taken from and returned to the pool.
    Prefill rows stand in for verification rows: both run the same matmuls, which is what
    grows with rows (the step of a long-context decode also reads its KV, so the measured
    cost is, if anything, on the high side)."""
    max_rows = max(1, min(max_rows, row_limit))
    counts = []
    rows = 1
    while True:
        counts.append(min(rows, max_rows))
        if rows >= max_rows:
            break
        rows *= 2
    tokens = [i % max(vocab_size, 1) for i in range(counts[-1])]
    seconds = []
    for n in [counts[0], *counts]:  # the first run warms the kernels up and is dropped
        seq = Sequence("step-cost", tokens[:n], None, 0)
        block_manager.allocate(seq.block_table, n)
        try:
            best = float("inf")
            for _ in range(MEASURE_REPEATS):
                start = time.perf_counter()
                execute([ScheduledSequence(seq, 0, n)])
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                best = min(best, time.perf_counter() - start)
            seconds.append(best)
        finally:
            block_manager.free(seq.block_table)
    curve = StepCostCurve(tuple(counts), tuple(seconds[1:]))
    logger.info("speculation cost model: forward pass by rows fed: %s", curve.describe())
    return curve
