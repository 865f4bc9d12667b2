"""FairSlots: per-tenant caps, a bounded wait, and fair order on a shared helper's slots."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import TenantQueueFullError
from gateway.fair_slots import FairSlots


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def slots(clock: Clock | None = None, **overrides) -> FairSlots:
    values = {"slots": 2, "per_tenant": 1, "queue_limit": 4, "name": "checks"}
    return FairSlots(**{**values, **overrides}, clock=clock or Clock())


async def holding(pool: FairSlots, tenant: str, release: asyncio.Event, order: list[str]):
    async with pool.hold(tenant):
        order.append(tenant)
        await release.wait()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_one_tenant_holds_at_most_its_cap_and_another_gets_a_slot_at_once():
    pool, release, order = slots(), asyncio.Event(), []
    flood = [asyncio.create_task(holding(pool, "a", release, order)) for _ in range(3)]
    await settle()
    assert (pool.held("a"), pool.waiting("a")) == (1, 2)  # one of two slots, whatever it sends
    victim = asyncio.create_task(holding(pool, "b", release, order))
    await settle()
    assert order == ["a", "b"]  # the free slot went to b at once
    release.set()
    await asyncio.gather(*flood, victim)
    assert order == ["a", "b", "a", "a"]
    assert pool.held("a") == pool.held("b") == 0


async def test_a_freed_slot_goes_to_the_tenant_that_has_held_slots_least():
    clock = Clock()
    pool, order = slots(clock, slots=1, per_tenant=1), []
    gates = {name: asyncio.Event() for name in ("a1", "a2", "b1")}

    async def run(tenant: str, gate: str) -> None:
        async with pool.hold(tenant):
            order.append(gate)
            await gates[gate].wait()
            clock.now += 1.0  # each hold lasts a second

    first = asyncio.create_task(run("a", "a1"))
    await settle()
    second = asyncio.create_task(run("a", "a2"))  # a's own next one waits first ...
    await settle()
    third = asyncio.create_task(run("b", "b1"))  # ... but b, who has held nothing, goes ahead
    await settle()
    for gate in gates.values():
        gate.set()
    await asyncio.gather(first, second, third)
    assert order == ["a1", "b1", "a2"]
    assert pool.counter("a") == 2.0 and pool.counter("b") == 1.0


async def test_a_tenant_past_its_queue_limit_is_refused_at_once():
    pool, release, order = slots(queue_limit=2), asyncio.Event(), []
    held = [asyncio.create_task(holding(pool, "a", release, order)) for _ in range(3)]
    await settle()
    with pytest.raises(TenantQueueFullError) as refused:
        async with pool.hold("a"):
            pass
    assert refused.value.status == 429 and refused.value.headers["retry-after"] == "1"
    async with pool.hold("b"):  # another tenant is not refused
        pass
    release.set()
    await asyncio.gather(*held)


async def test_a_waiter_that_leaves_gives_up_its_place_and_leaks_no_slot():
    pool, release, order = slots(slots=1), asyncio.Event(), []
    holder = asyncio.create_task(holding(pool, "a", release, order))
    await settle()
    leaving = asyncio.create_task(holding(pool, "b", release, order))
    await settle()
    leaving.cancel()
    await settle()
    assert pool.waiting("b") == 0
    release.set()
    await holder
    async with pool.hold("c"):  # the slot is free again
        assert pool.held("c") == 1
    assert order == ["a"]


async def test_a_newcomer_banks_no_credit_from_being_idle():
    clock = Clock()
    pool = slots(clock, slots=1)
    for _ in range(3):
        async with pool.hold("a"):
            clock.now += 1.0
    release, order = asyncio.Event(), []
    holder = asyncio.create_task(holding(pool, "a", release, order))
    await settle()
    # b arrives while a is active: it starts at a's counter, not at zero.
    newcomer = asyncio.create_task(holding(pool, "b", release, order))
    await settle()
    assert pool.counter("b") == pool.counter("a") == 3.0
    release.set()
    await asyncio.gather(holder, newcomer)


async def test_the_tokenizers_pool_serves_tenants_in_fair_order(model_dir):
    """A tenant with many long prompts queued on the tokenizer's pool does not hold another
    tenant's prompt behind all of them: the next free thread goes to the newcomer."""
    from gateway.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer.from_dir(model_dir, threads=1)
    text = "hello world " * 2000  # long enough for the pool
    order: list[str] = []

    async def encode(tenant: str) -> None:
        await tokenizer.encode_async(text, tenant=tenant)
        order.append(tenant)

    try:
        flood = [asyncio.create_task(encode("flood")) for _ in range(6)]
        await settle()
        victim = asyncio.create_task(encode("victim"))
        await asyncio.gather(*flood, victim)
    finally:
        tokenizer.close()
    assert order.index("victim") <= 2, order  # after at most the running job and one more
