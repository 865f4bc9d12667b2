"""The gateway's fair queue (gateway/fair_queue.py) as scripted scenarios: which request gets
each freed slot, in exact order, with real asyncio tasks and a clock the test moves."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import DeadlineExceededError, QueueTimeoutError, TenantQueueFullError
from gateway.fair_queue import BATCH, INTERACTIVE, FairQueue, Grant

TOKENS = 30


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_queue(*, max_in_flight: int = 1, limit: int = 64, timeout_s: float = 30.0, clock=None):
    return FairQueue(
        max_in_flight=max_in_flight,
        tenant_queue_limit=limit,
        timeout_s=timeout_s,
        clock=clock or Clock(),
    )


class Script:
    """Requests queued behind one slot, released one at a time: `order` is who got it."""

    def __init__(self, queue: FairQueue, workers: tuple[str, ...] = ("w",)) -> None:
        self.queue = queue
        self.workers = list(workers)
        self.order: list[str] = []
        self.grants: dict[str, Grant] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    async def hold(self, name: str, *, weight: float = 1.0, tokens: int = TOKENS) -> Grant:
        """A request that finds a slot free (the fast path)."""
        grant = await self.queue.acquire(
            tenant=name[0], weight=weight, tokens=tokens, workers=self.workers
        )
        self.grants[name] = grant
        return grant

    async def arrive(self, name: str, *, weight: float = 1.0, tokens: int = TOKENS, **kw) -> None:
        """Request `name` (its tenant is the first letter) starts waiting."""

        async def run() -> None:
            grant = await self.queue.acquire(
                tenant=name[0], weight=weight, tokens=tokens, workers=self.workers, **kw
            )
            self.order.append(name)
            self.grants[name] = grant

        self.tasks[name] = asyncio.create_task(run())
        await asyncio.sleep(0)  # it reaches its queue now, so arrival order is this order

    async def finish(self, name: str, *, used: int = TOKENS) -> None:
        self.queue.release(self.grants[name], used_tokens=used)
        await asyncio.sleep(0)  # the next waiter's task resumes

    async def drain(self, first: str) -> None:
        """Finish `first`, then each request as it gets the slot, until nobody waits."""
        await self.finish(first)
        done = 0
        while done < len(self.order):
            await self.finish(self.order[done])
            done += 1


async def test_weighted_dispatch_order_is_exact():
    """3:1 weights, equal requests: while both wait, a gets three slots per b's one; FIFO
    within each tenant; a tie goes to the tenant whose request came first."""
    script = Script(make_queue())
    await script.hold("a0", weight=3)
    for i in range(1, 7):
        await script.arrive(f"a{i}", weight=3)
    for i in range(1, 7):
        await script.arrive(f"b{i}", weight=1)
    await script.drain("a0")
    assert script.order == [
        "a1", "b1", "a2", "a3", "a4", "b2", "a5", "a6", "b3", "b4", "b5", "b6",
    ]  # fmt: skip
    assert script.queue.waiting() == 0 and script.queue.in_flight("w") == 0


async def test_three_to_one_weights_give_three_to_one_slots_while_both_wait():
    """Over a long backlog the slots split 75/25, and at every point of it the service
    difference stays within one request (the VTC bound)."""
    script = Script(make_queue())
    await script.hold("x", weight=1)
    for i in range(60):
        await script.arrive(f"a{i}", weight=3)
        await script.arrive(f"b{i}", weight=1)
    await script.drain("x")
    both_waiting = script.order[:80]  # a's 60 are gone after 80 slots
    served = {"a": 0, "b": 0}
    for name in both_waiting:
        served[name[0]] += 1
        assert abs(served["a"] / 3 - served["b"]) <= 1
    assert served == {"a": 60, "b": 20}


async def test_a_light_tenant_is_not_starved_by_a_heavy_one_that_keeps_its_queue_full():
    """a (premium, 4) refills its queue every time one of its requests is sent; c (free, 1)
    joins at a's counter (the lift) and gets the next slot; a's order stays FIFO."""
    script = Script(make_queue())
    await script.hold("z", weight=1)
    for i in range(4):
        await script.arrive(f"a{i}", weight=4)
    await script.arrive("c0", weight=1)
    await script.finish("z")
    refills = 4
    for _ in range(12):
        sent = script.order[-1]
        if sent.startswith("a"):
            await script.arrive(f"a{refills}", weight=4)
            refills += 1
        await script.finish(sent)
    assert script.order[:3] == ["a0", "c0", "a1"]
    a_order = [n for n in script.order if n[0] == "a"]
    assert a_order == sorted(a_order, key=lambda n: int(n[1:]))


async def test_a_returning_tenant_starts_at_the_lowest_waiting_counter():
    """Idle time is not banked: b, never served, joins a's backlog at a's counter, not at
    0; with nobody waiting, an arrival starts at the counter of the tenant served last."""
    queue = make_queue()
    script = Script(queue)
    await script.hold("a0")
    for i in range(1, 4):
        await script.arrive(f"a{i}")
    await script.finish("a0")
    await script.finish("a1")  # a served twice more: its counter is 3 requests' worth
    assert queue.counter("a") == 3 * TOKENS
    await script.arrive("b1")
    assert queue.counter("b") == queue.counter("a")  # lifted, not 0
    await script.drain("a2")
    assert script.order == ["a1", "a2", "a3", "b1"]  # the tie: a3 queued before b1


async def test_an_arrival_with_nobody_waiting_starts_at_the_last_served_counter():
    queue = make_queue(max_in_flight=2)
    script = Script(queue)
    for i in range(3):
        await script.hold(f"a{i}")
        await script.finish(f"a{i}")
    assert queue.counter("a") == 3 * TOKENS
    await script.hold("b0")
    assert queue.counter("b") == 3 * TOKENS + TOKENS  # a's counter, then b's own prompt


async def test_counters_are_trued_up_to_what_a_request_used():
    """Charged its prompt when sent, the rest of what it used when it ends; a request that
    never ran is refunded."""
    queue = make_queue(max_in_flight=2)
    grant = await queue.acquire(tenant="a", weight=2.0, tokens=10, workers=["w"])
    assert queue.counter("a") == 5.0
    queue.release(grant, used_tokens=10 + 50)  # 50 generated
    assert queue.counter("a") == 30.0
    unrun = await queue.acquire(tenant="a", weight=2.0, tokens=10, workers=["w"])
    queue.release(unrun, used_tokens=0)
    assert queue.counter("a") == 30.0
    queue.release(unrun, used_tokens=0)  # idempotent
    assert queue.counter("a") == 30.0 and queue.in_flight("w") == 0


async def test_a_full_tenant_queue_refuses_with_an_honest_retry_after_while_others_queue():
    clock = Clock()
    queue = make_queue(limit=2, clock=clock)
    script = Script(queue)
    await script.hold("a0")
    clock.now += 4.0
    await script.finish("a0")  # one request held its slot 4 s: the mean hold time
    await script.hold("a1")
    await script.arrive("a2")
    await script.arrive("a3")
    with pytest.raises(TenantQueueFullError) as refused:
        await queue.acquire(tenant="a", weight=1.0, tokens=TOKENS, workers=["w"])
    error = refused.value
    assert error.status == 429 and error.code == "rate_limit_exceeded"
    # One slot frees every 4 s, and a alone is backlogged: its queue has room in 4 s.
    assert error.headers["retry-after"] == "4" and error.headers["retry-after-ms"] == "4000"
    await script.arrive("b1", weight=1.0)  # b's own queue has room
    assert queue.waiting("b") == 1
    # With b backlogged at the same weight, a's share halves: 8 s.
    assert queue.retry_after_s("a", 1.0) == pytest.approx(8.0)
    await script.drain("a1")
    assert script.order == ["a2", "b1", "a3"]


async def test_no_queueing_at_all_with_a_limit_of_zero():
    queue = make_queue(limit=0)
    await queue.acquire(tenant="a", weight=1.0, tokens=1, workers=["w"])
    with pytest.raises(TenantQueueFullError) as refused:
        await queue.acquire(tenant="b", weight=1.0, tokens=1, workers=["w"])
    assert int(refused.value.headers["retry-after"]) >= 1


async def test_a_waiter_past_the_queue_timeout_or_its_deadline_gets_a_clear_error():
    queue = make_queue(timeout_s=0.05)
    grant = await queue.acquire(tenant="a", weight=1.0, tokens=1, workers=["w"])
    with pytest.raises(QueueTimeoutError) as waited:
        await queue.acquire(tenant="b", weight=1.0, tokens=1, workers=["w"])
    assert waited.value.status == 503 and waited.value.code == "queue_timeout"
    assert int(waited.value.headers["retry-after"]) >= 1
    with pytest.raises(DeadlineExceededError):
        await queue.acquire(tenant="b", weight=1.0, tokens=1, workers=["w"], deadline_s=0.01)
    assert queue.waiting() == 0 and queue.in_flight("w") == 1
    queue.release(grant, used_tokens=1)
    assert queue.in_flight("w") == 0  # nobody was left waiting to take it


async def test_a_waiter_whose_client_leaves_frees_nothing_and_the_next_gets_the_slot():
    queue = make_queue()
    script = Script(queue)
    await script.hold("a0")
    await script.arrive("b1")
    await script.arrive("c1")
    script.tasks["b1"].cancel()
    await asyncio.gather(script.tasks["b1"], return_exceptions=True)
    assert queue.waiting() == 1 and queue.in_flight("w") == 1
    await script.finish("a0")
    assert script.order == ["c1"] and queue.in_flight("w") == 1


async def test_a_slot_granted_as_the_client_leaves_goes_to_the_next_waiter():
    """The release hands b1 the slot, but b1's task is cancelled before it resumes: the
    slot passes to c1 instead of leaking."""
    queue = make_queue()
    script = Script(queue)
    await script.hold("a0")
    await script.arrive("b1")
    await script.arrive("c1")
    queue.release(script.grants["a0"], used_tokens=TOKENS)  # b1's future is set ...
    script.tasks["b1"].cancel()  # ... and its client leaves before it runs
    await asyncio.gather(script.tasks["b1"], return_exceptions=True)
    await asyncio.sleep(0)
    assert script.order == ["c1"]
    assert queue.in_flight("w") == 1 and queue.waiting() == 0
    assert queue.counter("b") == queue.counter("a")  # b charged nothing in the end


async def test_room_on_a_new_worker_goes_to_the_waiters_first():
    """A worker that appears adds room without a release: the first arrival that sees it
    hands it to the waiter in fair order, and waits behind it."""
    queue = make_queue()
    script = Script(queue)
    await script.hold("a0")
    await script.arrive("b1")
    script.workers = ["w", "w2"]
    await script.arrive("c1")
    await asyncio.sleep(0)
    assert script.order == ["b1"] and script.grants["b1"].worker_id == "w2"
    assert queue.waiting("c") == 1


async def test_a_retry_moves_the_slot_to_the_other_worker():
    queue = make_queue(max_in_flight=1)
    grant = await queue.acquire(tenant="a", weight=1.0, tokens=1, workers=["w", "w2"])
    queue.move(grant, "w2")
    assert (queue.in_flight("w"), queue.in_flight("w2")) == (0, 1)
    queue.release(grant, used_tokens=1)
    assert (queue.in_flight("w"), queue.in_flight("w2")) == (0, 0)


async def test_interactive_requests_take_every_freed_slot_before_batch_lines():
    """Bands first, then tenants' counters within a band: batch lines (band 1) waiting
    longer still go after every interactive request, and among themselves fairly."""
    script = Script(make_queue())
    await script.hold("z0")
    for name in ("a1", "a2", "b1"):
        await script.arrive(name, band=BATCH)
    for name in ("c1", "d1", "c2"):
        await script.arrive(name, band=INTERACTIVE)
    await script.drain("z0")
    assert script.order == ["c1", "d1", "c2", "a1", "b1", "a2"]


async def test_a_batch_line_never_takes_a_free_slot_ahead_of_a_waiting_request():
    """With an interactive request waiting, a batch line waits too, even when it arrives
    as a slot frees on another worker; an interactive one still passes waiting batch work."""
    script = Script(make_queue(), workers=("w",))
    await script.hold("z0")
    await script.arrive("a1", band=INTERACTIVE)
    await script.arrive("b1", band=BATCH)
    assert script.queue.waiting(band=BATCH) == 1 and script.queue.waiting(band=INTERACTIVE) == 1
    await script.finish("z0")
    assert script.order == ["a1"]
    await script.arrive("c1", band=INTERACTIVE)
    await script.finish("a1")
    await script.finish("c1")
    assert script.order == ["a1", "c1", "b1"]


async def test_batch_lines_hold_at_most_their_share_of_a_workers_slots():
    """4 slots, batch share 0.5: two batch lines run, the third waits though slots are free,
    and an interactive request takes one of those at once."""
    script = Script(make_queue(max_in_flight=4))
    for name in ("b1", "b2", "b3"):
        await script.arrive(name, band=BATCH)
    assert script.order == ["b1", "b2"] and script.queue.waiting(band=BATCH) == 1
    await script.hold("a1")
    await script.hold("c1")
    assert script.queue.in_flight("w") == 4
    await script.finish("a1")
    assert script.order == ["b1", "b2"]  # a1's slot is not a batch line's
    await script.finish("b1")
    assert script.order == ["b1", "b2", "b3"]
