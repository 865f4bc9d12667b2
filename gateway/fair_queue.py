"""Weighted fair queueing across tenants while every worker is saturated.

Why the gateway queues as well as the engine: the engine shares what reaches it, but without
a bound here one tenant's burst piles into every worker's waiting list (memory, and a longer
wait for everyone behind it), and only the gateway can tell that tenant, and only that
tenant, to come back later (429 with Retry-After). So this gateway keeps at most
`max_in_flight` requests on each worker; past that a request waits in its tenant's own
bounded queue, FIFO, and each freed slot goes to the backlogged tenant with the lowest
Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024):

- a tenant's counter grows by tokens / weight for the service it gets: its prompt when the
  request is sent (its prefill starts at once), the rest of what it used (generated tokens;
  a prompt never processed is refunded) when the request ends;
- a tenant that arrives with nothing waiting is lifted to the lowest counter of the tenants
  that are waiting, or, when none is, to the counter of the tenant served last (the paper's
  lift), so idle time is never banked as credit;
- ties go to the tenant whose first waiting request came first.

Priority bands: a request's band (interactive, or batch: the Batch API's lines) comes before
its tenant's counter. A freed slot goes to an interactive waiter while any waits, and a batch
line never takes a free slot ahead of one; within a band, tenants share by their counters as
above (one counter per tenant, whatever the band it was served in). Batch lines hold at most
`batch_share` of a worker's slots, so interactive requests never wait behind a worker full of
batch lines (each may hold its slot for a whole generation).

Everything is in-process and synchronous between awaits: a freed slot is handed straight to
the next waiter, so no newcomer can take it in between.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway import metrics
from gateway.errors import DeadlineExceededError, QueueTimeoutError, TenantQueueFullError

HOLD_EWMA = 0.1  # weight of each finished request in the mean time a slot is held


@dataclass(slots=True)
class Grant:
    """A request's slot on a worker, from `FairQueue.acquire` until `FairQueue.release`."""

    tenant: str
    weight: float
    tokens: int  # charged at dispatch (the prompt)
    worker_id: str
    granted_at: float
    released: bool = False
    band: int = 0  # INTERACTIVE


INTERACTIVE = 0  # the bands, as the worker's `Priority`: lower is served first
BATCH = 1


@dataclass(slots=True, eq=False)
class _Waiter:
    band: int
    tenant: str
    weight: float
    tokens: int
    seq: int  # arrival order, for ties and FIFO
    since: float
    future: asyncio.Future[Grant] = field(default_factory=asyncio.Future)
    queued: bool = True


class FairQueue:
    def __init__(
        self,
        *,
        max_in_flight: int,
        tenant_queue_limit: int,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        batch_share: float = 0.5,
    ) -> None:
        self.max_in_flight = max_in_flight
        self.max_batch_in_flight = max(1, int(max_in_flight * batch_share))
        self._batch_in_flight: dict[str, int] = {}  # worker id -> batch lines on it
        self.tenant_queue_limit = tenant_queue_limit
        self.timeout_s = timeout_s
        self.clock = clock
        self._in_flight: dict[str, int] = {}  # worker id -> this gateway's requests on it
        self._queues: dict[tuple[int, str], deque[_Waiter]] = {}  # (band, tenant): backlogged
        self._counters: dict[str, float] = {}
        self._last: str | None = None  # the tenant served last
        self._seq = itertools.count()
        self._hold_s: float | None = None  # mean time a slot is held, once one was released
        self._grants = 0  # grants not yet released ...
        self._grant_times = 0.0  # ... and the sum of their grant times (for their mean age)

    # -- what tests and metrics read ----------------------------------------------------------

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def waiting(self, tenant: str | None = None, *, band: int | None = None) -> int:
        return sum(
            len(q)
            for (b, t), q in self._queues.items()
            if (tenant is None or t == tenant) and (band is None or b == band)
        )

    def in_flight(self, worker_id: str) -> int:
        return self._in_flight.get(worker_id, 0)

    # -- the queue ----------------------------------------------------------------------------

    async def acquire(
        self,
        *,
        tenant: str,
        weight: float,
        tokens: int,
        workers: Sequence[str],
        deadline_s: float | None = None,
        band: int = INTERACTIVE,
    ) -> Grant:
        """A slot on the first of ``workers`` (best first) below `max_in_flight`, at once
        if one is free and nobody of its band or a higher one waits; else after waiting in
        ``tenant``'s queue of its band for at most `timeout_s` (or ``deadline_s``, the
        request's own remaining time, if sooner)."""
        if not any(t == tenant for _, t in self._queues):
            self._lift(tenant)
        if not any(b <= band for b, _ in self._queues):
            free = self._free(workers, band)
            if free is not None:
                return self._dispatch(tenant, weight, tokens, free, band)
        if self.waiting(tenant, band=band) >= self.tenant_queue_limit:
            metrics.QUEUE_REJECTIONS.labels(tenant=tenant, reason="full").inc()
            retry_s = self.retry_after_s(tenant, weight)
            raise TenantQueueFullError(
                f"Every worker is busy and tenant {tenant} has {self.waiting(tenant)} "
                f"requests queued, its limit. Please try again in {retry_s:.1f}s.",
                retry_after_s=retry_s,
            )
        waiter = _Waiter(band, tenant, weight, tokens, next(self._seq), self.clock())
        self._queues.setdefault((band, tenant), deque()).append(waiter)
        metrics.QUEUED_REQUESTS.labels(tenant=tenant).inc()
        self._pump(workers)  # room that came without a release (a new worker)
        limit = self.timeout_s if deadline_s is None else min(self.timeout_s, deadline_s)
        try:
            async with asyncio.timeout(max(limit, 0.0)):
                return await waiter.future
        except TimeoutError:
            if _granted(waiter):
                return waiter.future.result()  # granted as the time ran out
            if deadline_s is not None and deadline_s <= self.timeout_s:
                raise DeadlineExceededError(
                    "the request's deadline passed while it waited for a worker (every "
                    "worker was busy)"
                ) from None
            metrics.QUEUE_REJECTIONS.labels(tenant=tenant, reason="timeout").inc()
            raise QueueTimeoutError(
                f"the request waited {self.timeout_s:g} s for a worker (every worker was "
                "busy); retry later",
                retry_after_s=self.retry_after_s(tenant, weight),
            ) from None
        except BaseException:
            if _granted(waiter):  # granted as the client left: the slot goes on at once
                self.release(waiter.future.result(), used_tokens=0)
            raise
        finally:
            self._leave(waiter)

    def release(self, grant: Grant, *, used_tokens: int) -> None:
        """The request's call ended having used ``used_tokens`` (prompt processed + tokens
        generated): true up its tenant's counter and hand the slot to the next waiter.
        Idempotent."""
        if grant.released:
            return
        grant.released = True
        self._take_off(grant.worker_id, grant.band)
        extra = (used_tokens - grant.tokens) / grant.weight
        self._counters[grant.tenant] = self.counter(grant.tenant) + extra
        held = self.clock() - grant.granted_at
        self._hold_s = held if self._hold_s is None else (
            (1 - HOLD_EWMA) * self._hold_s + HOLD_EWMA * held
        )  # fmt: skip
        self._grants -= 1
        self._grant_times -= grant.granted_at
        self._pump([grant.worker_id])

    def move(self, grant: Grant, worker_id: str) -> None:
        """The request is retried on ``worker_id``: its slot goes with it (a retry may
        exceed that worker's bound by one: it is rare, and it already waited its turn)."""
        if grant.released or grant.worker_id == worker_id:
            return
        self._take_off(grant.worker_id, grant.band)
        self._put_on(worker_id, grant.band)
        grant.worker_id = worker_id

    def retry_after_s(self, tenant: str, weight: float) -> float:
        """When ``tenant``'s queue should have room again: the time for one of its requests
        to be sent, at the rate slots free up (in use / mean hold time) times its weighted
        share among the backlogged tenants."""
        if self._grants == 0:
            return 1.0
        hold = self._hold_s
        if hold is None:  # nothing ended yet: those in flight are, on average, half way
            hold = 2 * (self.clock() - self._grant_times / self._grants)
        weights = {t: q[0].weight for (_, t), q in self._queues.items()}
        weights[tenant] = weight
        share = weight / sum(weights.values())
        return max(1.0, hold / (self._grants * share))

    # -- policy -------------------------------------------------------------------------------

    def _lift(self, tenant: str) -> None:
        """A tenant with nothing waiting starts no lower than the waiting tenants' lowest
        counter, or, when none waits, the counter of the tenant served last."""
        if self._queues:
            floor = min(self.counter(t) for _, t in self._queues)
        else:
            floor = self.counter(self._last) if self._last is not None else 0.0
        self._counters[tenant] = max(self.counter(tenant), floor)

    def _next(self) -> _Waiter:
        """The first waiter, in the first band with any, of the backlogged tenant with the
        lowest counter (ties: the tenant whose first waiter came first)."""
        return min(
            (q[0] for q in self._queues.values()),
            key=lambda w: (w.band, self.counter(w.tenant), w.seq),
        )

    def _free(self, workers: Sequence[str], band: int) -> str | None:
        for worker_id in workers:
            if self._in_flight.get(worker_id, 0) >= self.max_in_flight:
                continue
            if band != INTERACTIVE and (
                self._batch_in_flight.get(worker_id, 0) >= self.max_batch_in_flight
            ):
                continue
            return worker_id
        return None

    def _dispatch(
        self, tenant: str, weight: float, tokens: int, worker_id: str, band: int
    ) -> Grant:
        self._put_on(worker_id, band)
        self._counters[tenant] = self.counter(tenant) + tokens / weight
        self._last = tenant
        now = self.clock()
        self._grants += 1
        self._grant_times += now
        return Grant(tenant, weight, tokens, worker_id, now, band=band)

    def _put_on(self, worker_id: str, band: int) -> None:
        self._in_flight[worker_id] = self.in_flight(worker_id) + 1
        if band != INTERACTIVE:
            self._batch_in_flight[worker_id] = self._batch_in_flight.get(worker_id, 0) + 1

    def _take_off(self, worker_id: str, band: int) -> None:
        for counts in (self._in_flight, self._batch_in_flight) if band else (self._in_flight,):
            count = counts[worker_id] - 1
            if count:
                counts[worker_id] = count
            else:
                del counts[worker_id]  # workers come and go: keep only those in use

    def _pump(self, workers: Sequence[str]) -> None:
        """Hand free slots on ``workers`` to waiters, in fair order."""
        while self._queues:
            waiter = self._next()
            free = self._free(workers, waiter.band)
            if free is None:
                return
            self._leave(waiter)
            if waiter.future.done():
                continue  # its task was cancelled and has not run its cleanup yet
            grant = self._dispatch(waiter.tenant, waiter.weight, waiter.tokens, free, waiter.band)
            waiter.future.set_result(grant)

    def _leave(self, waiter: _Waiter) -> None:
        """Take ``waiter`` out of its queue (if still there), counting its wait."""
        if not waiter.queued:
            return
        waiter.queued = False
        queue = self._queues[(waiter.band, waiter.tenant)]
        queue.remove(waiter)  # the head, unless it left early (timeout, client gone)
        if not queue:
            del self._queues[(waiter.band, waiter.tenant)]
        metrics.QUEUED_REQUESTS.labels(tenant=waiter.tenant).dec()
        metrics.QUEUE_WAIT.labels(tenant=waiter.tenant).observe(self.clock() - waiter.since)


def _granted(waiter: _Waiter) -> bool:
    future = waiter.future
    return future.done() and not future.cancelled() and future.exception() is None
