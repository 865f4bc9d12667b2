"""Offline models of adapter slots, for `bench.routing`: what a trace's adapter sequence costs
in loads under a given placement, counted as the workers count them.

A worker counts a *store load* the first time it serves an adapter (it keeps the adapter named,
and its host cache holds every adapter of the bench) and a *slot refill* each time it puts an
adapter into a device slot that held another one; its slots evict the coldest adapter by
decayed request counts (`worker.model.slot_eviction.SlotEviction`, used here as it is).

- `lru_cost`: one LRU over ``slots`` slots, as if the pool's slots were one worker's: perfect
  placement (every adapter on the worker whose LRU victim is the pool's), the best any router
  can do over LRU slots without replicating adapters.
- `heat_cost`: the same slots under the workers' rule: perfect placement over the workers'
  slots as they are.
- `lfu_cost`: the same slots evicting the adapter used least often so far (least recently
  used among equals): what a frequency-aware eviction rule in the workers could add to
  perfect placement, online, without knowing the future.
- `belady_cost`: the same slots evicting the adapter whose next use is furthest away (Belady,
  1966), the fewest slot fills any placement and eviction rule could reach on this trace;
  so no policy's loads can be lower.
- `replay`: a routing log (adapter, worker) in arrival order through each worker's own slots
  (the workers' rule, or LRU), to see where a policy's loads come from (per worker, per
  adapter, per stretch of the trace, per request).

All three serve requests one at a time in arrival order: requests that overlap on a worker
may share a slot or be reordered by its scheduler, which the measured counters include.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from worker.model.slot_eviction import SlotEviction


@dataclass
class Cost:
    """Loads as the workers count them."""

    store_loads: int = 0  # an adapter's first request on a worker
    slot_refills: int = 0  # a device slot refilled while it held another adapter

    @property
    def loads(self) -> int:
        return self.store_loads + self.slot_refills

    def per_1k(self, requests: int) -> float:
        return 1000 * self.loads / max(1, requests)


def lru_cost(adapters: Sequence[Hashable], slots: int) -> Cost:
    """``adapters`` (one per request, in order) through ``slots`` LRU slots."""
    held: OrderedDict[Hashable, None] = OrderedDict()
    seen: set[Hashable] = set()
    cost = Cost()
    for a in adapters:
        if a in held:
            held.move_to_end(a)
            continue
        cost.store_loads += a not in seen
        seen.add(a)
        if len(held) >= slots:
            held.popitem(last=False)
            cost.slot_refills += 1
        held[a] = None
    return cost


def heat_cost(adapters: Sequence[Hashable], slots: int) -> Cost:
    """``adapters`` through ``slots`` slots that evict as a worker does (`Slots`)."""
    held = Slots(slots, "heat")
    seen: set[Hashable] = set()
    cost = Cost()
    for a in adapters:
        if held.use(a):
            cost.store_loads += a not in seen
            cost.slot_refills += held.refilled
        seen.add(a)
    return cost


class Slots:
    """One worker's ``count`` slots, serving one request at a time: evicting by the workers'
    rule (``"heat"``) or the least recently used (``"lru"``)."""

    def __init__(self, count: int, rule: str = "heat") -> None:
        self.held: list[Hashable | None] = [None] * count
        self.last_use = [0] * count
        self.rule = SlotEviction() if rule == "heat" else None
        self.refilled = False  # the last `use` evicted an adapter
        self._step = 0

    def use(self, adapter: Hashable) -> bool:
        """Serve a request on ``adapter``; whether it had to be put in a slot."""
        self._step += 1
        key = str(adapter)
        if self.rule is not None:
            self.rule.arrived([key])
        missed = adapter not in self.held
        if missed:
            names = [None if h is None else str(h) for h in self.held]
            if self.rule is not None:
                slot = self.rule.victim(names, self.last_use, {key})
            else:
                slot = min(
                    range(len(self.held)),
                    key=lambda i: (self.held[i] is not None, self.last_use[i]),
                )
            self.refilled = self.held[slot] is not None
            self.held[slot] = adapter
        else:
            slot = self.held.index(adapter)
        self.last_use[slot] = self._step
        if self.rule is not None:
            self.rule.left([key])
        return missed


def lfu_cost(adapters: Sequence[Hashable], slots: int) -> Cost:
    """``adapters`` through ``slots`` slots that evict the adapter with the fewest requests
    so far (the least recently used of those)."""
    uses: dict[Hashable, int] = {}
    last: dict[Hashable, int] = {}
    held: set[Hashable] = set()
    cost = Cost()
    for i, a in enumerate(adapters):
        if a not in held:
            cost.store_loads += a not in uses
            if len(held) >= slots:
                held.remove(min(held, key=lambda h: (uses[h], last[h])))
                cost.slot_refills += 1
            held.add(a)
        uses[a] = uses.get(a, 0) + 1
        last[a] = i
    return cost


def belady_cost(adapters: Sequence[Hashable], slots: int) -> Cost:
    """``adapters`` through ``slots`` slots that evict the adapter needed furthest ahead
    (never, first): the minimum number of slot fills for this sequence."""
    never = len(adapters)
    next_use = [never] * len(adapters)
    upcoming: dict[Hashable, int] = {}
    for i in range(len(adapters) - 1, -1, -1):
        next_use[i] = upcoming.get(adapters[i], never)
        upcoming[adapters[i]] = i
    held: dict[Hashable, int] = {}  # adapter -> its next use
    seen: set[Hashable] = set()
    cost = Cost()
    for i, a in enumerate(adapters):
        if a not in held:
            cost.store_loads += a not in seen
            seen.add(a)
            if len(held) >= slots:
                del held[max(held, key=lambda h: (held[h], repr(h)))]
                cost.slot_refills += 1
        held[a] = next_use[i]
    return cost


@dataclass
class Replay:
    """A routing log's loads through per-worker slots, broken down four ways."""

    total: Cost = field(default_factory=Cost)
    by_worker: dict[str, Cost] = field(default_factory=dict)
    by_adapter: dict[Hashable, Cost] = field(default_factory=dict)  # the adapter brought in
    by_stretch: list[Cost] = field(default_factory=list)  # equal stretches of the log
    loaded: list[bool] = field(default_factory=list)  # per request: it had to fill a slot


def replay(
    log: Sequence[tuple[Hashable, str]], slots: int, *, stretches: int = 4, rule: str = "heat"
) -> Replay:
    """Each (adapter, worker) of ``log``, in order, through that worker's ``slots`` slots
    evicting by ``rule`` (`Slots`)."""
    held: dict[str, Slots] = {}
    seen: set[tuple[Hashable, str]] = set()
    out = Replay(by_stretch=[Cost() for _ in range(stretches)])
    for i, (a, worker) in enumerate(log):
        mine = held.setdefault(worker, Slots(slots, rule))
        missed = mine.use(a)
        out.loaded.append(missed)
        if not missed:
            continue
        costs = (
            out.total,
            out.by_worker.setdefault(worker, Cost()),
            out.by_adapter.setdefault(a, Cost()),
            out.by_stretch[i * stretches // len(log)],
        )
        store = (a, worker) not in seen
        seen.add((a, worker))
        for c in costs:
            c.store_loads += store
            c.slot_refills += mine.refilled
    return out
