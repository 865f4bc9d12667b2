"""What every kernel choice by measurement shares (``linear_choice`` for the projections,
``op_choice`` for the rest of a step): the plan (one kernel for small row counts, one for
large), the rule that picks it from timings, the guard against timings taken while other
processes held the CPU, and the on-disk cache beside the native kernels' builds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from switchboard_kernels import native

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 4, 16, 64, 256, 1024)
MEASURE_ROUNDS = 2  # the fastest round counts (noise only slows a run down)
# Within a round, a kernel's step that took less than SHORT_STEP_S in all is timed again, up
# to STEP_CALLS times, the fastest counting. On these 2-vCPU VMs a thread that wakes a
# sleeping OpenMP worker can wait ~8 ms for its core (seen on a Zen 5: a one-row LoRA step
# of 0.9 ms timed 8-10 ms in both rounds of half the engine starts, in the same place each
# round, and the plan took torch's path there, and with it the one-call decode step off
# every batch-1 request on an adapter: 77 instead of 180 tok/s); back-to-back calls find
# the core awake. Long steps, where such a wait is small beside the step, run once.
SHORT_STEP_S = 0.02
STEP_CALLS = 3
# A measurement during which our threads got less than this share of their cores' time was
# slowed by other processes unevenly, kernel by kernel: it is neither trusted nor cached.
MIN_CPU_SHARE = 0.6


def fastest_of_short(timed: Callable[[], float]) -> float:
    """Seconds of ``timed()``, called again while its calls stay short (``STEP_CALLS``,
    ``SHORT_STEP_S``), the fastest counting."""
    best = spent = timed()
    for _ in range(STEP_CALLS - 1):
        if spent > SHORT_STEP_S:
            break
        taken = timed()
        best, spent = min(best, taken), spent + taken
    return best


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """``small`` runs up to ``split_rows`` rows, ``large`` more (one kernel when equal);
    ``source``: "measured", "cached", "fixed" or "invariant"; ``fixed_order``: the kernels
    sum a lone row in the order of a tile of many (projections only, ``invariant_plan``)."""

    small: str
    large: str
    split_rows: int = 0
    source: str = "fixed"
    fixed_order: bool = False

    def kernel_for(self, rows: int) -> str:
        return self.small if rows <= self.split_rows else self.large

    @property
    def kernels(self) -> tuple[str, ...]:
        return (self.small,) if self.small == self.large else (self.small, self.large)

    def describe(self) -> str:
        if self.small == self.large:
            return f"{self.small} ({self.source})"
        return f"{self.small} up to {self.split_rows} rows, {self.large} above ({self.source})"

    def record(self) -> dict:
        return {"small": self.small, "large": self.large, "split_rows": self.split_rows}

    @classmethod
    def cached(cls, record: dict) -> KernelPlan:
        return cls(str(record["small"]), str(record["large"]), int(record["split_rows"]), "cached")


Seconds = dict[str, dict[int, float]]  # by kernel, then by rows


def choose(seconds: Seconds, *, dual: bool, source: str = "measured") -> KernelPlan:
    """The plan with the least total relative time over the measured buckets (each bucket's
    time over its fastest kernel's): one kernel, or, with ``dual``, a small-row kernel and a
    large-row kernel split at a bucket. Ties go to one kernel, then to the first listed."""
    buckets = sorted({r for times in seconds.values() for r in times})
    best = {r: min(t[r] for t in seconds.values() if r in t) for r in buckets}

    def cost(small: str, large: str, split: int) -> float:
        total = 0.0
        for r in buckets:
            kernel = small if r <= split else large
            total += seconds[kernel].get(r, math.inf) / best[r]
        return total

    names = list(seconds)
    options = [(cost(k, k, 0), 0, KernelPlan(k, k, 0, source)) for k in names]
    if dual:
        for small in names:
            for large in names:
                if small != large:
                    for split in buckets[:-1]:
                        plan = KernelPlan(small, large, split, source)
                        options.append((cost(small, large, split), 1, plan))
    return min(options, key=lambda option: option[:2])[2]


class CpuShare:
    """The CPU time this process got over the wall time of all its torch threads, from
    construction to ``share()``: below ``MIN_CPU_SHARE`` other processes took the cores."""

    def __init__(self) -> None:
        self.started, self.cpu_started = time.perf_counter(), time.process_time()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def share(self) -> float:
        wall = max(self.elapsed(), 1e-9) * torch.get_num_threads()
        return (time.process_time() - self.cpu_started) / wall


def cache_path(kind: str, *parts: bytes | str) -> Path:
    """Where a plan of ``kind`` measured under everything in ``parts`` (besides the CPU, torch
    and the threads, always part of the key) is cached."""
    key = hashlib.sha256()
    for part in (native._cpu_id(), torch.__version__, str(torch.get_num_threads()), *parts):
        key.update(part.encode() if isinstance(part, str) else part)
    base = os.environ.get(native.CACHE_ENV) or Path.home() / ".cache/switchboard/kernels"
    return Path(base) / "choices" / f"{kind}-{key.hexdigest()[:20]}.json"


def kernel_sources(*names: str) -> list[bytes]:
    """The native kernels' sources, for a cache key: a changed kernel is measured again."""
    return [Path(native.__file__).with_name(name).read_bytes() for name in names]


def read_record(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def write_record(path: Path, record: dict) -> None:
    """Written under a temporary name, then renamed: a reader never sees half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(record, indent=1))
        os.replace(temporary, path)
    except OSError as exc:
        logger.warning("could not cache a kernel plan at %s: %s", path, exc)


def describe_seconds(seconds: Seconds) -> str:
    return "; ".join(
        f"{k} " + ", ".join(f"{r}: {1000 * s:.2f}" for r, s in sorted(t.items()))
        for k, t in seconds.items()
    )


class Measured(Protocol):
    """What a measurement hands ``cached_or_measured``."""

    cpu_share: float

    def record(self) -> dict: ...  # what the cache keeps

    def summary(self) -> str: ...  # the plan and its timings, for the log


Plan = TypeVar("Plan")


def cached_or_measured(
    path: Path,
    what: str,
    *,
    read: Callable[[dict], Plan],
    measure: Callable[[], tuple[Plan, Measured]],
    fixed: Callable[[], Plan],
    describe: Callable[[Plan], str],
) -> Plan:
    """The plan cached at ``path`` (``read`` from its record), else ``measure``'s, logged
    and cached; or, when other processes held the CPU while it measured (below
    ``MIN_CPU_SHARE``), the ``fixed`` plan, neither trusted nor cached (the next start
    measures again)."""
    cached = read_record(path)
    if cached is not None:
        try:
            return read(cached)
        except (KeyError, TypeError, ValueError):
            pass  # an older or damaged record: measure again
    plan, result = measure()
    if result.cpu_share < MIN_CPU_SHARE:
        fallback = fixed()
        logger.warning(
            "%s measured while other processes took the CPU (our threads got %.0f%% of their "
            "cores); not trusted or cached: %s",
            what,
            100 * result.cpu_share,
            describe(fallback),
        )
        return fallback
    logger.info("%s measured: %s", what, result.summary())
    write_record(path, result.record())
    return plan
