"""A fixed number of slots on a shared helper (the grammar checkers, the tokenizer's threads),
shared fairly and boundedly by tenants.

- **Per-tenant concurrency.** A tenant holds at most `per_tenant` slots at once, however many
  requests it sends: one tenant cannot occupy the whole helper.
- **A bounded wait.** At most `queue_limit` of a tenant's requests wait for a slot; past that the
  request gets a 429 with Retry-After at once (`TenantQueueFullError`).
- **Fair order.** A freed slot goes to the waiting tenant (below its cap) that has held slots for
  the fewest seconds so far, charged when each hold ends; a tenant arriving with nothing waiting
  or held starts no lower than the lowest counter among the active tenants, so idle time is
  never banked (the Virtual Token Counter's lift, as in `gateway.fair_queue`, with time held as
  the service). Ties go to the earlier arrival.

A hold's time is charged to the tenant that held it, whatever its work did: a crash or a
timeout in the helper costs the tenant whose work caused it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from gateway.errors import TenantQueueFullError


@dataclass(slots=True, eq=False)
class _Waiter:
    tenant: str
    seq: int
    future: asyncio.Future[None] = field(default_factory=asyncio.Future)
    queued: bool = True


class FairSlots:
    def __init__(
        self,
        *,
        slots: int,
        per_tenant: int,
        queue_limit: int,
        name: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.slots = slots
        self.per_tenant = per_tenant
        self.queue_limit = queue_limit
        self.name = name  # in refusals: "grammar checks", "tokenizing"
        self.clock = clock
        self._held: dict[str, int] = {}  # tenant -> slots it holds (tenants holding any)
        self._queues: dict[str, deque[_Waiter]] = {}  # tenants waiting only
        self._counters: dict[str, float] = {}  # seconds held, by tenant
        self._seq = itertools.count()

    # -- what tests read ----------------------------------------------------------------------

    def held(self, tenant: str) -> int:
        return self._held.get(tenant, 0)

    def waiting(self, tenant: str) -> int:
        return len(self._queues.get(tenant, ()))

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    # -- the slots ----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def hold(self, tenant: str) -> AsyncIterator[None]:
        """A slot for ``tenant`` while the block runs (after a fair wait for one)."""
        await self._acquire(tenant)
        started = self.clock()
        try:
            yield
        finally:
            self._release(tenant, self.clock() - started)

    async def _acquire(self, tenant: str) -> None:
        if tenant not in self._queues and tenant not in self._held:
            self._lift(tenant)
        if self.waiting(tenant) >= self.queue_limit:
            raise TenantQueueFullError(
                f"tenant {tenant} has {self.waiting(tenant)} requests waiting for {self.name}, "
                "its limit; please try again shortly",
                retry_after_s=1.0,
            )
        waiter = _Waiter(tenant, next(self._seq))
        self._queues.setdefault(tenant, deque()).append(waiter)
        self._pump()  # granted at once when a slot is free and nobody fairer waits
        try:
            await waiter.future
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled():
                self._release(tenant, 0.0)  # granted as its task was cancelled: pass it on
            raise
        finally:
            self._leave(waiter)

    def _release(self, tenant: str, held_s: float) -> None:
        self._counters[tenant] = self.counter(tenant) + held_s
        count = self._held[tenant] - 1
        if count:
            self._held[tenant] = count
        else:
            del self._held[tenant]
        self._pump()

    # -- policy -------------------------------------------------------------------------------

    def _room(self, tenant: str) -> bool:
        return sum(self._held.values()) < self.slots and self.held(tenant) < self.per_tenant

    def _take(self, tenant: str) -> None:
        self._held[tenant] = self.held(tenant) + 1

    def _lift(self, tenant: str) -> None:
        active = self._queues.keys() | self._held.keys()
        if active:
            floor = min(self.counter(t) for t in active)
            self._counters[tenant] = max(self.counter(tenant), floor)

    def _pump(self) -> None:
        """Hand free slots to waiters, in fair order, each tenant up to its cap."""
        while True:
            eligible = [q[0] for t, q in self._queues.items() if self._room(t)]
            if not eligible:
                return
            waiter = min(eligible, key=lambda w: (self.counter(w.tenant), w.seq))
            self._leave(waiter)
            if waiter.future.done():
                continue  # its task was cancelled and has not run its cleanup yet
            self._take(waiter.tenant)
            waiter.future.set_result(None)

    def _leave(self, waiter: _Waiter) -> None:
        if not waiter.queued:
            return
        waiter.queued = False
        queue = self._queues[waiter.tenant]
        queue.remove(waiter)
        if not queue:
            del self._queues[waiter.tenant]
