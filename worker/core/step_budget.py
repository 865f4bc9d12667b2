"""A bound on how long a step that carries decodes may take (Sarathi-Serve's idea).

Agrawal et al. ("Taming Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve",
OSDI 2024): a decoding sequence gets one token per step, so its time per output token is the
step's time; a step that also carries a long prefill chunk stalls every decode in it. Their
stall-free batching caps the tokens of each step so that its time stays within a budget, the
rest of a prompt waiting for the next steps. Here the cap applies to a tenant's prompts while
another tenant is active (the scheduler's ``_schedule_prefills``); a step of prefills alone, or
of a lone tenant's prefills beside its own decodes, may still fill ``max_num_batched_tokens``.

The cap comes from what steps cost on this machine: ``StepTimes`` holds seconds by tokens fed,
first from a sweep at warm-up, then from the steps the engine runs (the median of the latest
in each band of sizes replaces the sweep's figure there). Without a budget set, the engine
takes ``default_budget``: ``IDLE_STEPS`` of a lone stream's decode steps, so a quiet tenant's
time per output token under another's flood stays within a few times its idle value (the
trade-off measured: docs/performance.md).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque

# Token counts the warm-up sweep times (clipped to the step's token limit).
SWEEP_TOKENS = (1, 16, 32, 64, 128, 256, 512, 1024, 2048)
# Rows of the decode steps it times (clipped to the sequences a step may hold).
SWEEP_DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)
# The default budget, in a lone stream's decode steps. Beside a 48-stream flood on a 2-core
# Zen 3 (fp32, bench.fairness), budgets of 60 and 100 ms (3 and 5 such steps of ~20 ms)
# computed the same tokens (248 tok/s, 0.82 of unbounded steps) and held the quiet tenant's
# time per output token alike (75 and 76 ms: a step's least prompt chunk and the flood's
# long-context decodes set it there): three, the bound issue 60 asks for, cost nothing there.
IDLE_STEPS = 3.0
# Prefill tokens a step may always add beside its decodes, however long they take, so that
# new requests are admitted and prompts advance while a batch decodes.
MIN_PREFILL_TOKENS = 16
# A tenant counts as active this long after its last sequence left: a closed-loop client's next
# request arrives just after its answer, and a step started in that gap would run uncapped (a
# second of one prompt chunk here) before its next prompt could join.
ACTIVE_GRACE_S = 1.0
# Observed steps: bands of half an octave of tokens fed, the latest kept per band, and how
# many before their median replaces the sweep's figure.
BANDS_PER_OCTAVE = 2
OBSERVED_WINDOW = 32
MIN_OBSERVATIONS = 4


def _band(tokens: int) -> int:
    return round(math.log2(tokens) * BANDS_PER_OCTAVE)


class StepTimes:
    """Seconds a step takes by the tokens it feeds (prompt chunks, decodes and drafts alike),
    as a curve through measured points that never falls as tokens grow."""

    def __init__(
        self,
        measured: dict[int, float] | None = None,
        *,
        window: int = OBSERVED_WINDOW,
        min_observations: int = MIN_OBSERVATIONS,
    ) -> None:
        # Per band: the sweep's point, then the steps observed there.
        self._measured = {_band(t): (float(t), s) for t, s in (measured or {}).items() if t > 0}
        self._observed: dict[int, tuple[deque[int], deque[float]]] = {}
        self.window = window
        self.min_observations = min_observations
        self._curve: tuple[list[float], list[float]] | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        """A step that fed ``tokens`` and took ``seconds``."""
        if tokens < 1 or not seconds > 0:
            return
        band = _band(tokens)
        seen = self._observed.get(band)
        if seen is None:
            seen = self._observed[band] = (deque(maxlen=self.window), deque(maxlen=self.window))
        seen[0].append(tokens)
        seen[1].append(seconds)
        if len(seen[1]) >= self.min_observations:
            self._curve = None

    @property
    def known(self) -> bool:
        return bool(self.points()[0])

    def points(self) -> tuple[list[float], list[float]]:
        """The curve's points: (tokens, seconds), tokens rising, seconds never falling."""
        if self._curve is None:
            points = dict(self._measured)
            for band, (tokens, seconds) in self._observed.items():
                if len(seconds) >= self.min_observations:
                    points[band] = (statistics.median(tokens), statistics.median(seconds))
            xs, ys = [], []
            for band in sorted(points):
                x, y = points[band]
                xs.append(x)
                ys.append(max(y, ys[-1]) if ys else y)
            self._curve = (xs, ys)
        return self._curve

    def seconds(self, tokens: float) -> float | None:
        """The predicted time of a step of ``tokens``; past the last point, time grows in
        proportion to tokens (no cheaper per token than there); None when nothing is known."""
        xs, ys = self.points()
        if not xs:
            return None
        if tokens >= xs[-1]:
            return ys[-1] * tokens / xs[-1]
        i = bisect.bisect_right(xs, tokens)
        if i == 0:
            return ys[0]
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def max_tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step may feed and still take at most ``seconds`` (0 when even
        the smallest step known takes longer); None when nothing is known."""
        xs, ys = self.points()
        if not xs:
            return None
        if seconds < ys[0]:
            return 0
        if seconds >= ys[-1]:
            return math.floor(xs[-1] * seconds / ys[-1])
        i = bisect.bisect_right(ys, seconds)  # ys[i - 1] <= seconds < ys[i]
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return math.floor(x0 + (x1 - x0) * (seconds - y0) / (y1 - y0))

    def describe(self) -> str:
        xs, ys = self.points()
        return ", ".join(f"{x:.0f} tok {1000 * y:.1f} ms" for x, y in zip(xs, ys, strict=True))


def default_budget(
    measured: dict[int, float],
    decodes: dict[int, float] | None = None,
    *,
    idle_steps: float = IDLE_STEPS,
) -> float | None:
    """``idle_steps`` times a lone stream's step: the one-row decode step as ``decodes``
    timed it (on a CPU the one-call native step, what a stream alone waits per token), else
    the sweep's one-token step; None without either."""
    for one in ((decodes or {}).get(1), measured.get(1)):
        if one is not None and one > 0:
            return idle_steps * one
    return None


class DecodeStepBudget:
    """``seconds``: the most a step that carries decodes should take; ``token_cap`` turns it
    into tokens through ``times`` (None while nothing is known: no cap). ``decode_times``: the
    seconds of steps that feed decodes alone, by rows (``worker.core.bands`` prices the batch
    rows beside interactive decodes with it): on a CPU such a step takes the native decode
    step (switchboard_kernels/decode_step_cpu.c), about half the time of a step of as many
    prompt tokens, which ``times`` is made of."""

    def __init__(
        self, times: StepTimes, seconds: float, decode_times: StepTimes | None = None
    ) -> None:
        if not seconds > 0:
            raise ValueError(f"a step budget must be positive, got {seconds!r} s")
        self.times = times
        self.seconds = seconds
        self.decode_times = decode_times if decode_times is not None else StepTimes()

    def observe(self, tokens: int, decode_rows_only: bool, seconds: float) -> None:
        """A step the engine ran: every step on ``times`` (the budget's curve, as it always
        was), one that fed decodes alone on ``decode_times`` too."""
        self.times.observe(tokens, seconds)
        if decode_rows_only:
            self.decode_times.observe(tokens, seconds)

    def token_cap(self) -> int | None:
        return self.times.max_tokens_within(self.seconds)

    def describe(self) -> str:
        cap = self.token_cap()
        tokens = "no cap yet" if cap is None else f"{cap} tokens"
        return (
            f"{1000 * self.seconds:.1f} ms ({tokens}; steps: {self.times.describe()}; "
            f"decode steps: {self.decode_times.describe()})"
        )
