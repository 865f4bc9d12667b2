"""The routing policy on synthetic workers, and the worker directory over the real registry."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from gateway.errors import NoWorkerError
from gateway.fair_queue import Grant
from gateway.routing import WorkerDirectory, rank_workers, rendezvous_score
from runtime.registry import WorkerInfo, register


def make_worker(worker_id: str, *, load: int = 0, adapters=(), model="m") -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        address=f"127.0.0.1:{50000 + hash(worker_id) % 1000}",
        model=model,
        adapters=list(adapters),
        running=load,
        heartbeat_at=time.time(),
    )


def ids(workers) -> list[str]:
    return [w.worker_id for w in workers]


def test_base_model_goes_to_the_least_loaded():
    workers = [make_worker("a", load=5), make_worker("b", load=1), make_worker("c", load=3)]
    assert ids(rank_workers(workers, adapter_id=None)) == ["b", "c", "a"]
    # What this gateway sent since its last registry read counts as load too.
    ranked = rank_workers(workers, adapter_id=None, extra_load={"b": 3})
    assert ids(ranked) == ["c", "b", "a"]


def test_a_worker_holding_the_adapter_comes_first():
    workers = [make_worker("a"), make_worker("b", load=2, adapters=["x"]), make_worker("c")]
    assert ids(rank_workers(workers, adapter_id="x"))[0] == "b"


def test_holder_over_the_load_bound_spills_to_the_rendezvous_order():
    workers = [make_worker("a"), make_worker("b", load=20, adapters=["x"]), make_worker("c")]
    ranked = ids(rank_workers(workers, adapter_id="x", load_factor=1.5, load_slack=4))
    assert ranked[-1] == "b"
    favourite = max(["a", "c"], key=lambda w: rendezvous_score("x", w))
    assert ranked[0] == favourite


@pytest.mark.parametrize("num_workers", [1, 2, 3, 7])
def test_rendezvous_is_stable_and_spreads_adapters(num_workers):
    workers = [make_worker(f"w{i}") for i in range(num_workers)]
    adapters = [f"{i:064x}" for i in range(400)]
    first = {a: rank_workers(workers, adapter_id=a)[0].worker_id for a in adapters}
    shuffled = random.Random(0).sample(workers, len(workers))
    assert first == {a: rank_workers(shuffled, adapter_id=a)[0].worker_id for a in adapters}
    counts = {w.worker_id: list(first.values()).count(w.worker_id) for w in workers}
    expected = len(adapters) / num_workers
    assert all(0.6 * expected <= c <= 1.4 * expected for c in counts.values()), counts


def test_removing_a_worker_moves_only_its_own_adapters():
    workers = [make_worker(f"w{i}") for i in range(5)]
    adapters = [f"adapter-{i}" for i in range(300)]
    before = {a: rank_workers(workers, adapter_id=a)[0].worker_id for a in adapters}
    after = {a: rank_workers(workers[1:], adapter_id=a)[0].worker_id for a in adapters}
    moved = {a for a in adapters if before[a] != after[a]}
    assert moved == {a for a in adapters if before[a] == "w0"}


def test_second_choice_is_another_worker():
    workers = [make_worker("a"), make_worker("b")]
    for adapter in (None, "x"):
        assert set(ids(rank_workers(workers, adapter_id=adapter))) == {"a", "b"}
    assert rank_workers([], adapter_id="x") == []


@pytest.fixture
def redis(redis_client):
    return redis_client


class Clock:
    """The directory's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def directory(redis, prefix, **kwargs) -> WorkerDirectory:
    values = {"model_names": frozenset({"m"}), "heartbeat_ttl_s": 10.0, "cache_s": 0.0}
    return WorkerDirectory(redis=redis, prefix=prefix, **{**values, **kwargs})


async def test_directory_skips_dead_stale_and_foreign_workers(redis, redis_prefix):
    await register(redis, redis_prefix, make_worker("live"), ttl=30)
    await register(redis, redis_prefix, make_worker("other-model", model="n"), ttl=30)
    stale = make_worker("stale")
    stale.heartbeat_at = time.time() - 60
    await register(redis, redis_prefix, stale, ttl=30)
    await redis.sadd(f"{redis_prefix}workers", "expired")  # listed, but its key is gone
    by_path = make_worker("by-path", model="/models/m")
    await register(redis, redis_prefix, by_path, ttl=30)
    found = await directory(redis, redis_prefix).workers()
    assert sorted(ids(found)) == ["by-path", "live"]


async def test_directory_reads_again_ahead_of_expiry_without_making_callers_wait(
    redis, redis_prefix
):
    """Past cache_s (and within twice it) a call still gets the cached list at once and
    starts a read in the background; the next call sees its result."""
    clock = Clock()
    d = directory(redis, redis_prefix, cache_s=2.0, clock=clock)
    await register(redis, redis_prefix, make_worker("a"), ttl=30)
    assert ids(await d.workers()) == ["a"]
    await register(redis, redis_prefix, make_worker("b"), ttl=30)
    clock.now += 2.5  # due to be read again, not too old to serve meanwhile
    assert ids(await d.workers()) == ["a"]  # cached, without waiting for Redis
    # The clock stands still, so only the read started above can bring "b" in (a call on
    # the caller's time would take an age of 2 * cache_s); 10 s guards against a hang.
    deadline = time.monotonic() + 10.0
    while ids(await d.workers()) != ["a", "b"]:
        assert time.monotonic() < deadline, "the background read never landed"
        await asyncio.sleep(0.01)


async def test_directory_caches_and_skips_failed_workers(redis, redis_prefix):
    d = directory(redis, redis_prefix, cache_s=60.0)
    with pytest.raises(NoWorkerError):
        await d.candidates(adapter_id=None)
    d = directory(redis, redis_prefix, cache_s=60.0)
    await register(redis, redis_prefix, make_worker("a"), ttl=30)
    await register(redis, redis_prefix, make_worker("b", load=1), ttl=30)
    assert ids(await d.candidates(adapter_id=None)) == ["a", "b"]
    await register(redis, redis_prefix, make_worker("c"), ttl=30)
    assert ids(await d.candidates(adapter_id=None)) == ["a", "b"]  # cached
    d.sent("a")
    d.sent("a")
    assert ids(await d.candidates(adapter_id=None)) == ["b", "a"]
    d.failed("b")
    assert ids(await d.candidates(adapter_id=None)) == ["a"]


async def two_recorded_workers(redis, redis_prefix):
    """A directory over workers a (load 0) and b (load 1), both recorded by a heartbeat at
    999 (wall time, now 1000); its cache and wall clocks to move by hand."""
    clock, wall = Clock(), Clock()
    wall.now = 1000.0
    d = directory(redis, redis_prefix, cache_s=1.0, clock=clock)
    d.wall_clock = wall
    for name in ("a", "b"):
        info = make_worker(name, load=1 if name == "b" else 0)
        info.heartbeat_at = 999.0
        await register(redis, redis_prefix, info, ttl=30)
    return d, clock, wall


async def test_a_send_counts_until_a_heartbeat_written_after_it(redis, redis_prefix):
    """The registry's record is as old as the worker's last heartbeat: a request sent after
    it stays on the worker's load across the directory's reads, until a newer record."""
    d, clock, wall = await two_recorded_workers(redis, redis_prefix)
    assert ids(await d.candidates(adapter_id=None)) == ["a", "b"]
    d.sent("a")
    d.sent("a")  # at 1000: a's load 0 + 2
    clock.now += 5.0  # read again: the records are the same heartbeat's
    assert ids(await d.candidates(adapter_id=None)) == ["b", "a"]
    # a's next heartbeat (at 1001) counts both requests itself, and one more: the sends are
    # dropped (a is 3, not 5); one to b after its record stays (b is 1 + 1).
    info = make_worker("a", load=3)
    info.heartbeat_at = 1001.0
    await register(redis, redis_prefix, info, ttl=30)
    wall.now = 1002.0
    d.sent("b")
    clock.now += 5.0
    assert ids(await d.candidates(adapter_id=None)) == ["b", "a"]
    assert d._sent == {"b": [(1002.0, None)]}


async def test_a_send_that_ended_here_counts_no_more(redis, redis_prefix):
    """A request that ended at this gateway (its slot released) or moved to another worker
    is off the worker's load before the next heartbeat: one client's requests one after
    another do not pile up on an adapter's holder while its record is unchanged."""
    d, clock, _ = await two_recorded_workers(redis, redis_prefix)
    grants = [Grant("t", 1.0, 1, "a", 0.0) for _ in range(2)]
    for grant in grants:
        d.sent("a", grant)
    assert ids(await d.candidates(adapter_id=None)) == ["b", "a"]  # a 0 + 2, b 1
    grants[0].released = True
    moved = grants[1]
    moved.worker_id = "b"  # retried there: b's load now (its own send), not a's
    d.sent("b", moved)
    assert ids(await d.candidates(adapter_id=None)) == ["a", "b"]  # a 0, b 1 + 1
    moved.released = True
    clock.now += 5.0  # a read drops what ended
    assert ids(await d.candidates(adapter_id=None)) == ["a", "b"]
    assert d._sent == {}


async def test_two_gateways_agree_on_every_adapters_workers(redis, redis_prefix):
    """Two replicas reading one registry rank every adapter's workers the same way: the
    policy keeps no per-replica random state (what a replica sent itself is load it adds
    until a heartbeat written after it, and it is counted the same way by each)."""
    slots = {"a": ["x", "y"], "b": ["y", None], "c": ["z", "w"]}
    for name, load in (("a", 1), ("b", 0), ("c", 3)):
        info = make_worker(name, load=load)
        info.slot_adapters = slots[name]
        await register(redis, redis_prefix, info, ttl=30)
    one, two = directory(redis, redis_prefix), directory(redis, redis_prefix)
    for adapter in ["x", "y", "z", "w", *(f"{i:064x}" for i in range(50)), None]:
        first = ids(await one.candidates(adapter_id=adapter))
        assert first == ids(await two.candidates(adapter_id=adapter)), adapter
        assert sorted(first) == ["a", "b", "c"]
    # The same sends since the workers' heartbeats: the same choice.
    for d in (one, two):
        d.sent("a")
        d.sent("a")
    for adapter in ["x", "y", *(f"{i:064x}" for i in range(50))]:
        assert ids(await one.candidates(adapter_id=adapter)) == ids(
            await two.candidates(adapter_id=adapter)
        )
    assert ids(await one.candidates(adapter_id="y"))[0] == "b"  # the less loaded holder
