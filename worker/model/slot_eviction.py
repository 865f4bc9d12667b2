"""Which device slot a new adapter takes: the coldest adapter's, never a busy one's.

An adapter's *heat* on a worker is its requests there, each counting 1 when it arrives and
halving every ``half_life`` arrivals on the worker since: an exponentially decayed use count,
LRFU's combined recency and frequency (Lee et al., "LRFU: A Spectrum of Policies that Subsumes
the Least Recently Used and Least Frequently Used Policies", IEEE Trans. Computers, 2001). The
clock is the worker's arrivals, not seconds, so the rule reads the same at any request rate.

Heat is kept per adapter whether it holds a slot or not: a popular adapter displaced once
(a burst of cold ones) comes back with its count and is not the next to go, where LRU would
evict it as soon as it is the oldest. A count is forgotten once it decays below ``FORGET``.

The victim, among the slots the step does not need (their adapters run in it): an empty slot;
else a slot whose adapter has no request on the worker (queued or running), the coldest, the
least recently used of equals; a slot whose adapter has queued requests only when every other
candidate has some too (the scheduler started a request that needs a slot now).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

# Below this an adapter's heat is forgotten: 4 half-lives after a single request.
FORGET = 1 / 16


class SlotEviction:
    """Adapters' decayed request counts and open requests on one worker, and the slot rule."""

    def __init__(self, *, half_life: float = 64.0) -> None:
        """``half_life``: arrivals on this worker after which a request counts half."""
        if half_life <= 0:
            raise ValueError("half_life must be positive")
        self.half_life = half_life
        self.now = 0  # arrivals so far: the clock heat decays by
        self._heat: dict[str, tuple[float, int]] = {}  # content id -> (heat, at arrival)
        self.open: Counter[str] = Counter()  # content id -> its requests queued or running

    def arrived(self, adapter_ids: Iterable[str], *, sequences: int = 1) -> None:
        """A request on ``adapter_ids`` (one, or a mix's each) arrived, as ``sequences``
        sequences (its samples); each adapter's heat grows by one."""
        self.now += 1
        for adapter_id in adapter_ids:
            self._heat[adapter_id] = (self.heat(adapter_id) + 1.0, self.now)
            self.open[adapter_id] += sequences
        if self.now % max(1, round(self.half_life)) == 0:
            self._forget()

    def left(self, adapter_ids: Iterable[str]) -> None:
        """One sequence on ``adapter_ids`` finished or was aborted."""
        for adapter_id in adapter_ids:
            if self.open[adapter_id] <= 1:
                del self.open[adapter_id]
            else:
                self.open[adapter_id] -= 1

    def heat(self, adapter_id: str) -> float:
        """``adapter_id``'s decayed request count now (0 if never seen or forgotten)."""
        value, at = self._heat.get(adapter_id, (0.0, self.now))
        return value * 0.5 ** ((self.now - at) / self.half_life)

    def victim(self, slots: Sequence[str | None], last_use: Sequence[int], needed: set[str]) -> int:
        """The slot to fill among ``slots`` (content id held, None: empty), given each slot's
        last step of use and the adapters this step runs (never evicted; the scheduler
        admits at most as many adapters as there are slots, so one slot is always free)."""
        candidates = [i for i, held in enumerate(slots) if held not in needed]

        def order(i: int) -> tuple[bool, bool, float, int]:
            held = slots[i]
            if held is None:
                return (False, False, 0.0, last_use[i])
            return (True, held in self.open, self.heat(held), last_use[i])

        return min(candidates, key=order)

    def _forget(self) -> None:
        cold = [a for a in self._heat if a not in self.open and self.heat(a) < FORGET]
        for adapter_id in cold:
            del self._heat[adapter_id]
