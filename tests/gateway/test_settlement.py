"""The settle stage (`gateway.settlement.settle`): however a request ended, it is counted once
with its final status, its worker slot goes back to the fair queue, and its quota reservation
is settled with what it used, in the quota windows and in usage alike.

Real parts throughout: a `QuotaService` on the real Redis (its state read back key by key), a
`FairQueue`, an `Admission`, the gateway's metrics registry.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from gateway import metrics
from gateway.admission import Admission
from gateway.errors import RateLimitError
from gateway.fair_queue import FairQueue, Grant
from gateway.job import Job
from gateway.metrics import RequestObservation
from gateway.settlement import settle
from gateway.tally import Tally
from gateway.tenancy.quotas import Quota, QuotaService, tenant_key, utc_day
from gateway.tenancy.usage import usage_key
from rpc import worker_pb2

TENANT = "acme"
MODEL = "tiny-chat"
PROMPT = list(range(10))  # 10 tokens
LIMITS = Quota(tokens_per_minute=1000, max_concurrent_requests=4, daily_tokens=10_000)


def make_job(request_id: str, *, max_tokens: int = 20, n: int = 2, weight: float = 1.0) -> Job:
    """A resolved request reserving 10 + 20 × 2 = 50 tokens by default."""
    return Job(
        request_id=request_id,
        created=1_700_000_000,
        model=MODEL,
        tenant=TENANT,
        prompt_ids=PROMPT,
        params=worker_pb2.SamplingParams(max_tokens=max_tokens, n=n),
        adapter=None,
        deadline=asyncio.get_running_loop().time() + 30.0,
        tenant_weight=weight,
    )


@dataclass
class Request:
    """One request's pieces, as the pipeline holds them when it settles."""

    job: Job
    tally: Tally
    admission: Admission
    observation: RequestObservation
    grant: Grant | None

    async def settle(self, *, queue: FairQueue, quotas: QuotaService) -> None:
        await settle(
            self.job,
            self.tally,
            admission=self.admission,
            observation=self.observation,
            queue=queue,
            quotas=quotas,
        )


@pytest.fixture
async def quotas(redis_client, redis_prefix):
    service = QuotaService(redis_client, prefix=redis_prefix, lease_s=30.0, fail_open=False)
    await service.set_quota(TENANT, LIMITS)
    yield service
    await service.close()


@pytest.fixture
def queue() -> FairQueue:
    return FairQueue(max_in_flight=4, tenant_queue_limit=8, timeout_s=5.0)


@pytest.fixture
def admitted(quotas, queue):
    """``await admitted("r1")``: a request admitted (reserved) and granted a slot on w1."""
    metrics.known_model(TENANT, MODEL)  # as resolve does: the model is a label value

    async def make(request_id: str, *, route: bool = True, **job_fields) -> Request:
        job = make_job(request_id, **job_fields)
        admission = Admission(quotas, TENANT, request_id=request_id, tokens=job.reserved_tokens)
        await admission.admit()
        grant = None
        if route:
            grant = await queue.acquire(
                tenant=TENANT, weight=job.tenant_weight, tokens=len(PROMPT), workers=["w1"]
            )
        tally = Tally(grant=grant)
        observation = RequestObservation(tenant=TENANT, model=MODEL, endpoint="chat")
        return Request(job, tally, admission, observation, grant)

    return make


def counted(status: int) -> float:
    """Requests counted so far with this final status (the gateway's metric)."""
    labels = {"tenant": TENANT, "model": MODEL, "endpoint": "chat", "status": str(status)}
    return metrics.REGISTRY.get_sample_value("switchboard_requests_total", labels) or 0.0


async def windows(client, prefix: str) -> dict:
    """The tenant's quota state in Redis: the token window, the leases, today's budget."""
    key = lambda name: tenant_key(prefix, TENANT, name)  # noqa: E731
    return {
        "tokens_total": await client.get(key("tokens_total")),
        "token_log": await client.zrange(key("tokens"), 0, -1),
        "in_flight": await client.zrange(key("inflight"), 0, -1),
        "daily": await client.get(key(f"daily:{utc_day()}")),
    }


async def usage(client, prefix: str) -> dict[str, str]:
    return await client.hgetall(usage_key(prefix, TENANT, utc_day()))


def generated(tally: Tally, *, finished: bool = True) -> Tally:
    """Two samples of 7 and 5 tokens, 4 prompt tokens from the prefix cache."""
    tally.started = True
    tally.completion = {0: 7, 1: 5}
    tally.cached_tokens = 4
    tally.finished = finished
    return tally


# --- a request that finished ---------------------------------------------------------------------


async def test_admission_reserves_the_prompt_and_every_samples_max_tokens(
    admitted, redis_client, redis_prefix
):
    await admitted("r1")
    assert await windows(redis_client, redis_prefix) == {
        "tokens_total": "50",
        "token_log": ["r1|50"],
        "in_flight": ["r1"],
        "daily": "50",
    }


async def test_a_finished_request_is_settled_with_what_it_used(
    admitted, queue, quotas, redis_client, redis_prefix
):
    request = await admitted("r1")
    generated(request.tally)
    before = counted(200)
    await request.settle(queue=queue, quotas=quotas)
    # used: the prompt (10) + both samples (7 + 5) = 22 of the 50 reserved
    assert await windows(redis_client, redis_prefix) == {
        "tokens_total": "22",
        "token_log": ["r1|22"],
        "in_flight": [],
        "daily": "22",
    }
    assert await usage(redis_client, redis_prefix) == {
        "tiny-chat|requests": "1",
        "tiny-chat|prompt_tokens": "10",
        "tiny-chat|completion_tokens": "12",
        "tiny-chat|cached_tokens": "4",
    }
    assert counted(200) - before == 1
    assert request.observation.done
    assert request.admission.reservation.settled


async def test_the_worker_slot_goes_back_with_the_tokens_used(admitted, queue, quotas):
    """The tenant's virtual counter: its prompt at dispatch, the rest of what it used at
    the end (22 tokens at weight 1)."""
    request = await admitted("r1")
    assert (queue.in_flight("w1"), queue.counter(TENANT)) == (1, 10.0)
    generated(request.tally)
    await request.settle(queue=queue, quotas=quotas)
    assert request.grant.released
    assert (queue.in_flight("w1"), queue.counter(TENANT)) == (0, 22.0)


async def test_the_counter_grows_by_tokens_over_the_tenants_weight(admitted, queue, quotas):
    request = await admitted("r1", weight=2.0)
    assert queue.counter(TENANT) == 5.0  # 10 / 2 at dispatch
    generated(request.tally)
    await request.settle(queue=queue, quotas=quotas)
    assert queue.counter(TENANT) == 11.0  # 22 / 2 in all


async def test_a_freed_slot_goes_to_the_next_waiter(quotas, redis_client, redis_prefix):
    queue = FairQueue(max_in_flight=1, tenant_queue_limit=8, timeout_s=5.0)
    first = await queue.acquire(tenant=TENANT, weight=1.0, tokens=10, workers=["w1"])
    waiting = asyncio.create_task(
        queue.acquire(tenant="globex", weight=1.0, tokens=3, workers=["w1"])
    )
    await asyncio.sleep(0)
    assert queue.waiting("globex") == 1
    job = make_job("r1")
    admission = Admission(quotas, TENANT, request_id="r1", tokens=job.reserved_tokens)
    await admission.admit()
    observation = RequestObservation(tenant=TENANT, model=MODEL, endpoint="chat")
    request = Request(job, generated(Tally(grant=first)), admission, observation, first)
    await request.settle(queue=queue, quotas=quotas)
    granted = await asyncio.wait_for(waiting, 1.0)
    assert (granted.tenant, granted.worker_id, queue.in_flight("w1")) == ("globex", "w1", 1)


# --- settled once --------------------------------------------------------------------------------


async def test_a_request_is_settled_once(admitted, queue, quotas, redis_client, redis_prefix):
    """A stream that ended and then failed reaches settle twice: the second changes nothing."""
    request = await admitted("r1")
    generated(request.tally)
    before = counted(200), counted(502)  # the metrics registry is the process's
    await request.settle(queue=queue, quotas=quotas)
    settled = await windows(redis_client, redis_prefix)
    request.tally.error_status = 502  # what a late failure would leave
    await request.settle(queue=queue, quotas=quotas)
    assert await windows(redis_client, redis_prefix) == settled
    assert (await usage(redis_client, redis_prefix))["tiny-chat|requests"] == "1"
    assert (counted(200) - before[0], counted(502) - before[1]) == (1, 0)
    assert (queue.counter(TENANT), queue.in_flight("w1")) == (22.0, 0)


async def test_a_status_counted_first_by_a_failure_stays(admitted, queue, quotas):
    """The pipeline counts a failure's status before it settles: settle adds no second count."""
    request = await admitted("r1")
    generated(request.tally, finished=False)
    before = counted(504), counted(499)
    request.observation.finish(504)
    await request.settle(queue=queue, quotas=quotas)
    assert (counted(504) - before[0], counted(499) - before[1]) == (1, 0)


@pytest.mark.parametrize(
    ("finished", "error_status", "status"),
    [(True, None, 200), (False, None, 499), (True, 502, 502)],
)
async def test_the_final_status_is_the_tallys(
    admitted, queue, quotas, finished, error_status, status
):
    request = await admitted("r1")
    generated(request.tally, finished=finished)
    request.tally.error_status = error_status
    before = counted(status)
    await request.settle(queue=queue, quotas=quotas)
    assert counted(status) - before == 1


# --- requests that ended early -------------------------------------------------------------------


async def test_a_request_no_worker_started_pays_nothing_but_counts(
    admitted, queue, quotas, redis_client, redis_prefix
):
    """The client left before the prompt was processed: no tokens, one request."""
    request = await admitted("r1")
    await request.settle(queue=queue, quotas=quotas)
    assert await windows(redis_client, redis_prefix) == {
        "tokens_total": "0",
        "token_log": [],
        "in_flight": [],
        "daily": "0",
    }
    assert await usage(redis_client, redis_prefix) == {"tiny-chat|requests": "1"}
    assert queue.counter(TENANT) == 0.0  # the prompt charged at dispatch is refunded


async def test_a_departed_client_pays_what_the_worker_reported(
    admitted, queue, quotas, redis_client, redis_prefix
):
    request = await admitted("r1")
    request.tally.record(worker_pb2.GenerateResponse(index=0, text="x", completion_tokens=2))
    request.tally.charge_reported(
        worker_pb2.AbortResponse(found=True, prompt_tokens=10, completion_tokens=30)
    )
    await request.settle(queue=queue, quotas=quotas)
    assert (await windows(redis_client, redis_prefix))["tokens_total"] == "40"  # 10 + 30
    assert await usage(redis_client, redis_prefix) == {
        "tiny-chat|requests": "1",
        "tiny-chat|prompt_tokens": "10",
        "tiny-chat|completion_tokens": "30",
    }


async def test_a_request_that_was_never_routed_still_settles_its_reservation(
    admitted, queue, quotas, redis_client, redis_prefix
):
    request = await admitted("r1", route=False)
    await request.settle(queue=queue, quotas=quotas)
    assert (await windows(redis_client, redis_prefix))["in_flight"] == []
    assert await usage(redis_client, redis_prefix) == {"tiny-chat|requests": "1"}


async def test_a_refused_request_settles_nothing_in_redis(
    quotas, queue, redis_client, redis_prefix
):
    """Refused at admission: no reservation, so no usage; its own count is its 429."""
    await quotas.set_quota(TENANT, Quota(requests_per_minute=1))
    admitted_first = Admission(quotas, TENANT, request_id="r1", tokens=50)
    await admitted_first.admit()
    job = make_job("r2")
    refused = Admission(quotas, TENANT, request_id="r2", tokens=job.reserved_tokens)
    with pytest.raises(RateLimitError):
        await refused.admit()
    observation = RequestObservation(tenant=TENANT, model=MODEL, endpoint="chat")
    observation.finish(429)
    await Request(job, Tally(), refused, observation, None).settle(queue=queue, quotas=quotas)
    requests_log = await redis_client.zrange(tenant_key(redis_prefix, TENANT, "requests"), 0, -1)
    assert requests_log == ["r1"]
    assert await usage(redis_client, redis_prefix) == {}


async def test_a_tenant_without_limits_still_has_its_usage_counted(
    quotas, queue, redis_client, redis_prefix
):
    await quotas.set_quota(TENANT, Quota())
    job = make_job("r1")
    admission = Admission(quotas, TENANT, request_id="r1", tokens=job.reserved_tokens)
    await admission.admit()
    observation = RequestObservation(tenant=TENANT, model=MODEL, endpoint="chat")
    request = Request(job, generated(Tally()), admission, observation, None)
    await request.settle(queue=queue, quotas=quotas)
    assert await windows(redis_client, redis_prefix) == {
        "tokens_total": None,
        "token_log": [],
        "in_flight": [],
        "daily": None,
    }
    assert await usage(redis_client, redis_prefix) == {
        "tiny-chat|requests": "1",
        "tiny-chat|prompt_tokens": "10",
        "tiny-chat|completion_tokens": "12",
        "tiny-chat|cached_tokens": "4",
    }


async def test_a_cancelled_settlement_still_settles_the_quota(
    admitted, queue, quotas, redis_client, redis_prefix
):
    """A server shutting down cancels the request; its quota slot still comes back (the
    settlement is shielded, and its script runs on the batcher's own task)."""
    request = await admitted("r1")
    generated(request.tally)
    settling = asyncio.create_task(request.settle(queue=queue, quotas=quotas))
    await asyncio.sleep(0)  # it runs up to its Redis call
    settling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await settling
    assert request.grant.released  # released before the quota call, synchronously
    async with asyncio.timeout(5):
        while (await windows(redis_client, redis_prefix))["in_flight"]:
            await asyncio.sleep(0.01)
    assert await windows(redis_client, redis_prefix) == {
        "tokens_total": "22",
        "token_log": ["r1|22"],
        "in_flight": [],
        "daily": "22",
    }
