"""A step of batch work that gives the machine back mid-pass when interactive work arrives.

On a CPU a step of batch work alone runs for up to ``bands.BATCH_STEP_S`` (every batch decode
and prompt chunks), and an interactive request that arrives meanwhile used to wait for all of
it: its first token came that much later (bench.batch: the TTFT of a chat's first request
after a quiet spell 2-3x idle). A step the engine ``arm``s may be stopped at the start of any
layer: another thread's ``request`` sets a flag that the torch path reads before each layer
and before a layer's MLP and its down projection (``check``: an arrival waits for at most
half a layer's products), and the native decode step before each layer (``address``). The
engine then drops the step whole (``StepAbandoned``): nothing it did counts. The K/V it wrote
lie at positions its sequences have not computed, which nobody reads and the step that
computes them again overwrites; the scheduler's charges are per position and not made twice
(``ServiceLedger.cost``). An arrival waits for part of a layer instead of a whole step; the
batch loses the part of the step already run.

Only a step whose every sequence is batch work is armed, and only where the whole pass runs
in this process (no tensor-parallel group: every rank must run every layer).
"""

from __future__ import annotations

import ctypes
import threading


class StepAbandoned(Exception):
    """The armed step was stopped by an interactive arrival; it is to be dropped whole."""


class StepInterrupt:
    """The flag: armed by the engine around a step of batch work, requested from any thread."""

    def __init__(self) -> None:
        self._flag = ctypes.c_int32(0)  # read by decode_step_cpu.c between layers
        self._lock = threading.Lock()  # so that a request never outlives its step's arming
        self.armed = False
        self.abandoned = 0  # steps dropped since start (metrics)

    @property
    def address(self) -> int:
        """Where the native decode step reads the flag (an int32, nonzero: stop)."""
        return ctypes.addressof(self._flag)

    def arm(self) -> None:
        with self._lock:
            self.armed = True
            self._flag.value = 0

    def disarm(self) -> None:
        with self._lock:
            self.armed = False
            self._flag.value = 0

    def request(self) -> bool:
        """Stop the step in flight if it is armed; whether one was."""
        with self._lock:
            if self.armed:
                self._flag.value = 1
            return self.armed

    @property
    def requested(self) -> bool:
        """Whether the step in flight was asked to stop (and has not yet been dropped)."""
        return bool(self._flag.value)

    def check(self) -> None:
        """Between a layer's parts: raise ``StepAbandoned`` if the armed step was asked to
        stop."""
        if self._flag.value:
            raise StepAbandoned
