"""QuotaService against a real Redis: exact limits, reservations and refunds that add up,
leases that expire, usage counts, and the explicit fail mode when Redis is gone."""

from __future__ import annotations

import asyncio
import random
import socket

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from gateway import metrics
from gateway.errors import RateLimitError, StateUnavailableError
from gateway.tenancy.quotas import Quota, QuotaService, duration, tenant_key
from gateway.tenancy.usage import UsageDelta, read_usage

T = "acme"


@pytest.fixture
def client(redis_client):
    return redis_client


@pytest.fixture
def make_service(client, redis_prefix):
    services = []

    def make(quota: Quota | None = None, **kwargs) -> QuotaService:
        kwargs.setdefault("lease_s", 30.0)
        kwargs.setdefault("fail_open", False)
        service = QuotaService(client, prefix=redis_prefix, **kwargs)
        services.append(service)
        return service

    return make


def key(prefix: str, name: str) -> str:
    return tenant_key(prefix, T, name)


async def window_total(client, prefix) -> tuple[int, int]:
    """(running total, sum over the token log's entries): the two must always agree."""
    total = int(await client.get(key(prefix, "tokens_total")) or 0)
    members = await client.zrange(key(prefix, "tokens"), 0, -1)
    return total, sum(int(m.rsplit("|", 1)[1]) for m in members)


async def admit(service, tokens=1, rid=None):
    return await service.admit(T, request_id=rid or f"r{random.random()}", tokens=tokens)


async def settle(service, reservation, used, model="base"):
    await service.settle(reservation, used_tokens=used, usage=UsageDelta(model=model))


async def test_room_is_what_the_last_admission_left(make_service):
    """`take_room`, the hint for deciding beside the worker call: only after an admission,
    only while what it left covers the request, and never after a refusal."""
    service = make_service()
    assert not service.take_room(T, 10)  # never decided here
    await admit(service, tokens=10)
    assert all(service.take_room(T, 10**9) for _ in range(100))  # no limits
    await service.set_quota(T, Quota(requests_per_minute=3, tokens_per_minute=100))
    await admit(service, tokens=10)  # 2 requests and 90 tokens left
    assert not service.take_room(T, 91)
    assert service.take_room(T, 45)  # counted: 1 request and 45 tokens left
    assert not service.take_room(T, 46)
    assert service.take_room(T, 45)
    assert not service.take_room(T, 1)  # no request left
    await service.set_quota(T, Quota(max_concurrent_requests=1))
    reservation = await admit(service)
    assert not service.take_room(T, 1)  # its one slot is taken
    with pytest.raises(RateLimitError):
        await admit(service)
    await settle(service, reservation, 1)
    assert not service.take_room(T, 1)  # refused last: decided first until admitted again


async def test_admission_runs_work_beside_the_decision_only_with_room(make_service):
    """`Admission.run`: work starts before the decision only once the tenant had room,
    and a refusal cancels work already running."""
    from gateway.admission import Admission

    service = make_service()
    started_undecided: list[bool] = []

    def work_for(admission: Admission, *, forever: bool = False):
        async def work() -> str:
            started_undecided.append(admission.reservation is None)
            if forever:
                await asyncio.Event().wait()
            return "done"

        return work

    for expected in (False, True):  # the first decision comes first; then there is room
        admission = Admission(service, T, request_id=f"r{expected}", tokens=5)
        assert await admission.run(work_for(admission)) == "done"
        assert started_undecided.pop() is expected
        await settle(service, admission.reservation, 5)

    async def fails() -> None:
        raise ValueError("no worker")

    admission = Admission(service, T, request_id="failed", tokens=5)
    with pytest.raises(ValueError):
        await admission.run(fails)
    assert admission.reservation is not None  # admitted all the same: the caller settles it
    await settle(service, admission.reservation, 0)

    await service.set_quota(T, Quota(daily_tokens=1))  # this gateway's room is now stale
    admission = Admission(service, T, request_id="refused", tokens=5)
    work = work_for(admission, forever=True)
    with pytest.raises(RateLimitError):
        await asyncio.wait_for(admission.run(work), 5)  # not forever: the work was cancelled
    assert started_undecided == [True] and admission.reservation is None
    await service.set_quota(T, Quota())
    await admit(service)  # room again (no limits), and stale again:
    await service.set_quota(T, Quota(daily_tokens=1))
    assert service.take_room(T, 5)
    with pytest.raises(RateLimitError):  # the refusal outranks the work's own failure
        await Admission(service, T, request_id="both", tokens=5).run(fails)


async def test_requests_per_minute_is_exact_and_explains_itself(make_service):
    service = make_service()
    await service.set_quota(T, Quota(requests_per_minute=5))
    admitted = [await admit(service) for _ in range(5)]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in admitted] == list("43210")
    assert admitted[0].headers["x-ratelimit-limit-requests"] == "5"
    with pytest.raises(RateLimitError) as info:
        await admit(service)
    error = info.value
    assert (error.status, error.type, error.code) == (429, "requests", "rate_limit_exceeded")
    assert "Limit 5, Used 5, Requested 1" in error.message
    assert error.headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(error.headers["retry-after"]) <= 60
    assert 0 < int(error.headers["retry-after-ms"]) <= 60_000
    # Settling does not give a request back: it was made.
    await settle(service, admitted[0], used=1)
    with pytest.raises(RateLimitError):
        await admit(service)


async def test_the_window_slides(make_service):
    service = make_service(window_ms=600)
    await service.set_quota(T, Quota(requests_per_minute=2, tokens_per_minute=100))
    await admit(service, tokens=60)
    await asyncio.sleep(0.3)
    await admit(service, tokens=40)
    with pytest.raises(RateLimitError) as info:
        await admit(service, tokens=1)
    # The first entry leaves about 0.3 s from now: that is when to retry.
    assert 100 <= int(info.value.headers["retry-after-ms"]) <= 600
    await asyncio.sleep(0.35)
    second = await admit(service, tokens=60)  # the first (60 tokens) has left the window
    assert second.headers["x-ratelimit-remaining-tokens"] == "0"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"


async def test_token_reservations_and_refunds_add_up_exactly(make_service, client, redis_prefix):
    service = make_service()
    await service.set_quota(T, Quota(tokens_per_minute=1000))
    first, second, third = [await admit(service, tokens=300) for _ in range(3)]
    assert await window_total(client, redis_prefix) == (900, 900)
    with pytest.raises(RateLimitError) as info:
        await admit(service, tokens=300)
    assert info.value.type == "tokens" and "Used 900, Requested 300" in info.value.message
    assert info.value.headers["x-ratelimit-remaining-tokens"] == "100"

    await settle(service, first, used=100)  # 200 back
    assert await window_total(client, redis_prefix) == (700, 700)
    fourth = await admit(service, tokens=300)
    assert await window_total(client, redis_prefix) == (1000, 1000)
    await settle(service, fourth, used=0)  # never ran: all back
    await settle(service, fourth, used=0)  # idempotent
    await settle(service, second, used=300)  # used it all: nothing back
    await settle(service, third, used=299)
    assert await window_total(client, redis_prefix) == (100 + 300 + 299, 699)


async def test_random_reserve_and_settle_sequences_keep_the_books(
    make_service, client, redis_prefix
):
    service = make_service()
    await service.set_quota(T, Quota(tokens_per_minute=5000, daily_tokens=10**6))
    rng = random.Random(7)
    open_, expected = [], 0
    for _ in range(120):
        if open_ and rng.random() < 0.5:
            reservation = open_.pop(rng.randrange(len(open_)))
            used = rng.randint(0, reservation.tokens)
            await settle(service, reservation, used=used)
            expected -= reservation.tokens - used
        else:
            tokens = rng.randint(1, 400)
            try:
                open_.append(await admit(service, tokens=tokens))
                expected += tokens
            except RateLimitError:
                assert expected + tokens > 5000
        assert await window_total(client, redis_prefix) == (expected, expected)
        day = open_[0].day if open_ else None
        if day:
            assert int(await client.get(key(redis_prefix, f"daily:{day}"))) == expected


async def test_a_request_larger_than_the_limit_is_told_not_to_retry(make_service):
    service = make_service()
    await service.set_quota(T, Quota(tokens_per_minute=100))
    with pytest.raises(RateLimitError) as info:
        await admit(service, tokens=101)
    assert info.value.headers["x-should-retry"] == "false"
    assert "retry-after" not in info.value.headers
    assert "Request too large" in info.value.message


async def test_concurrency_slots_are_released_and_leases_expire(make_service, client, redis_prefix):
    service = make_service(lease_s=0.6)
    await service.set_quota(T, Quota(max_concurrent_requests=2))
    a, b = await admit(service), await admit(service)
    with pytest.raises(RateLimitError) as info:
        await admit(service)
    assert "Limit 2, Running 2" in info.value.message
    await settle(service, a, used=0)
    c = await admit(service)
    # Renewal keeps a running request's slot beyond its lease...
    await asyncio.sleep(0.9)
    with pytest.raises(RateLimitError):
        await admit(service)
    # ...and a gateway that dies stops renewing: its slots come back when the lease ends.
    for dead in (b, c):
        dead.renewal.cancel()
    await asyncio.sleep(0.7)
    d = await admit(service)
    await settle(service, d, used=0)
    e, f = await admit(service), await admit(service)
    for r in (e, f):
        await settle(service, r, used=0)
    assert await client.zcard(key(redis_prefix, "inflight")) == 0


async def test_a_settled_lease_cannot_be_renewed_back_to_life(make_service, client, redis_prefix):
    """A renewal still on its way when its request settles (the renewal task is cancelled,
    but its script was already sent) must not put the released slot back."""
    service = make_service(lease_s=30.0)
    await service.set_quota(T, Quota(max_concurrent_requests=1))
    running = await admit(service)
    assert await service.renew(running)
    await settle(service, running, used=0)
    assert not await service.renew(running)  # the late renewal lands after the settlement
    assert await client.zcard(key(redis_prefix, "inflight")) == 0
    other = await admit(service)  # the one slot is free
    await settle(service, other, used=0)


async def test_an_expired_lease_cannot_be_renewed(make_service, client, redis_prefix):
    service = make_service(lease_s=0.2)
    await service.set_quota(T, Quota(max_concurrent_requests=1))
    stalled = await admit(service)
    stalled.renewal.cancel()  # its gateway stalls past the lease
    await asyncio.sleep(0.3)
    assert not await service.renew(stalled)
    newcomer = await admit(service)  # the expired lease did not come back to hold the slot
    await settle(service, newcomer, used=0)
    await settle(service, stalled, used=0)
    assert await client.zcard(key(redis_prefix, "inflight")) == 0


async def test_daily_budget(make_service):
    service = make_service()
    await service.set_quota(T, Quota(daily_tokens=500))
    first = await admit(service, tokens=300)
    with pytest.raises(RateLimitError) as info:
        await admit(service, tokens=300)
    error = info.value
    assert (error.type, error.code) == ("insufficient_quota", "insufficient_quota")
    assert 1 <= int(error.headers["retry-after"]) <= 86400
    await settle(service, first, used=100)
    await admit(service, tokens=300)


async def test_no_quota_means_no_limits_and_no_bookkeeping(make_service, client, redis_prefix):
    service = make_service()
    reservations = [await admit(service, tokens=10**6) for _ in range(20)]
    assert all(r.headers == {} and r.renewal is None for r in reservations)
    keys = [k async for k in client.scan_iter(match=f"{redis_prefix}*")]
    assert keys == []


async def test_quota_round_trip_and_unlimited_fields(make_service):
    service = make_service()
    assert await service.get_quota(T) == Quota()
    quota = Quota(requests_per_minute=10, daily_tokens=1000)
    await service.set_quota(T, quota)
    assert await service.get_quota(T) == quota
    await service.set_quota(T, Quota(tokens_per_minute=5))
    assert await service.get_quota(T) == Quota(tokens_per_minute=5)


async def test_settlement_counts_usage_per_model_and_day(make_service, client, redis_prefix):
    service = make_service()
    for model, prompt, completion, cached in [
        ("base", 10, 5, 0),
        ("sql", 7, 3, 4),
        ("sql", 1, 1, 0),
    ]:
        reservation = await admit(service, tokens=100)
        usage = UsageDelta(
            model=model, prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached
        )
        await service.settle(reservation, used_tokens=prompt + completion, usage=usage)
    rows = await read_usage(client, prefix=redis_prefix, tenants=[T], days=[reservation.day])
    assert [
        (r["model"], r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in rows
    ] == [
        ("base", 1, 10, 5),
        ("sql", 2, 8, 4),
    ]
    assert rows[1]["cached_tokens"] == 4 and rows[1]["total_tokens"] == 12


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("fail_open", [False, True])
async def test_redis_down_follows_the_configured_fail_mode(redis_prefix, fail_open):
    dead = aioredis.Redis(host="127.0.0.1", port=_closed_port(), retry=Retry(NoBackoff(), 0))
    service = QuotaService(dead, prefix=redis_prefix, lease_s=5, fail_open=fail_open)
    outcome = "admitted" if fail_open else "refused"

    def errors() -> float:
        sample = "switchboard_quota_redis_errors_total"
        return metrics.REGISTRY.get_sample_value(sample, {"outcome": outcome}) or 0.0

    before = errors()
    try:
        if fail_open:
            reservation = await admit(service, tokens=10)
            assert reservation.metered is False and reservation.renewal is None
            await settle(service, reservation, used=10)  # logged and counted, never raises
        else:
            with pytest.raises(StateUnavailableError):
                await admit(service, tokens=10)
    finally:
        await dead.aclose()
    assert errors() == before + 1


@pytest.mark.parametrize(
    "ms, text",
    [
        (0, "0ms"),
        (20, "20ms"),
        (1000, "1s"),
        (6500, "6.5s"),
        (60_000, "1m0s"),
        (90_250, "1m30.25s"),
    ],
)
def test_durations_read_like_openais(ms, text):
    assert duration(ms) == text
