"""The batch runner (gateway/batch/runner.py) on the real Redis and a filesystem store, with
the request pipeline replaced by a counting stand-in: a runner stopped dead after any
transition, or with lines in flight, leaves a batch the next runner finishes with every line
recorded once and billed once; leases keep two runners off one batch and hand a dead one's
batch over; a line the pipeline refuses is an error line, a failure it did not cause is
retried."""

from __future__ import annotations

import asyncio
import io
import json
from collections import Counter

import pytest

from gateway.batch.batches import BatchRef, BatchService
from gateway.batch.files import FileLimits, FileService
from gateway.batch.runner import BatchRunner, RunnerConfig
from gateway.batch.states import BatchStatus
from gateway.batch.storage import FilesystemBlobs
from gateway.errors import ModelNotFoundError, NoWorkerError
from gateway.job import Job
from gateway.tally import Tally
from gateway.tenancy.usage import read_usage
from rpc import worker_pb2

TENANT = "acme"
NUM_LINES = 6


class Pipeline:
    """Stands in for resolve_line / answer_line: counts each line's runs; `delay` per answer;
    model "nope" is unknown (404); the first `flaky` answers find no worker (503); answers
    after the first `answer_only` never finish (lines held in flight until cancelled)."""

    def __init__(
        self, *, delay: float = 0.0, flaky: int = 0, answer_only: int | None = None
    ) -> None:
        self.delay = delay
        self.flaky = flaky
        self.answer_only = answer_only
        self.started = 0
        self.answered: Counter[str] = Counter()

    async def resolve(self, tenant: str, body) -> Job:
        if body.model == "nope":
            raise ModelNotFoundError(body.model)
        return Job(
            request_id=f"req-{body.messages[0].content}",
            created=0,
            model=body.model,
            tenant=tenant,
            prompt_ids=[1, 2, 3],
            params=worker_pb2.SamplingParams(max_tokens=4),
            adapter=None,
            deadline=1e18,
        )

    async def answer(self, body, job: Job, tally: Tally) -> dict:
        if self.flaky:
            self.flaky -= 1
            raise NoWorkerError("no worker")
        self.started += 1
        if self.answer_only is not None and self.started > self.answer_only:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay)
        tally.started = True
        tally.completion[0] = 4
        self.answered[body.messages[0].content] += 1
        return {"text": body.messages[0].content.upper()}


def line(i: int, model: str = "m") -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": f"p{i}"}]}
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


@pytest.fixture
def services(redis_client, redis_prefix, tmp_path):
    files = FileService(
        redis_client,
        prefix=redis_prefix,
        blobs=FilesystemBlobs(tmp_path / "files"),
        limits=FileLimits(quota_bytes=1 << 20, retention_s=86400),
    )
    batches = BatchService(redis_client, prefix=redis_prefix, files=files, windows={"24h": 86400})
    return files, batches


def make_runner(redis_client, services, pipeline: Pipeline, *, lease_s: float = 5.0):
    files, batches = services
    config = RunnerConfig(
        max_batches=2, lines_in_flight=2, lease_s=lease_s, poll_s=0.02, max_lines=100
    )
    return BatchRunner(
        redis_client, batches=batches, files=files, resolve=pipeline.resolve,
        answer=pipeline.answer, config=config,
    )  # fmt: skip


async def submit(services, lines: list[dict], **options) -> BatchRef:
    files, batches = services
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    uploaded = await files.create(
        TENANT, source=io.BytesIO(data), filename="in.jsonl", purpose="batch"
    )
    batch = await batches.create(
        TENANT, input_file_id=uploaded.id, endpoint="/v1/chat/completions",
        completion_window="24h", **options,
    )  # fmt: skip
    return BatchRef(TENANT, batch.id)


async def output_rows(services, file_id: str) -> list[dict]:
    files, _ = services
    return [json.loads(x) for x in (await files.read(TENANT, file_id)).decode().splitlines()]


async def billed_requests(redis_client, redis_prefix) -> int:
    from datetime import UTC, datetime

    day = datetime.now(UTC).date().isoformat()
    rows = await read_usage(redis_client, prefix=redis_prefix, tenants=[TENANT], days=[day])
    return sum(r["requests"] for r in rows)


async def test_a_batch_runs_to_completed_with_its_lines_in_order(
    redis_client, redis_prefix, services
):
    pipeline = Pipeline()
    lines = [line(i) for i in range(4)] + [line(9, model="nope")]
    ref = await submit(services, lines, output_expires_after_s=7200)
    await make_runner(redis_client, services, pipeline).advance(ref)
    batch = await services[1].get(ref)
    output = await services[0].get(TENANT, batch.output_file_id)
    assert output.purpose == "batch_output" and output.expires_at - output.created_at == 7200
    assert batch.status is BatchStatus.COMPLETED
    assert batch.counts == {"total": 5, "completed": 4, "failed": 1}
    assert batch.usage == {"input_tokens": 12, "output_tokens": 16, "cached_tokens": 0}
    rows = await output_rows(services, batch.output_file_id)
    assert [r["custom_id"] for r in rows] == ["c0", "c1", "c2", "c3"]
    assert rows[0]["response"] == {
        "status_code": 200, "request_id": "req-p0", "body": {"text": "P0"},
    }  # fmt: skip
    (error,) = await output_rows(services, batch.error_file_id)
    assert error["custom_id"] == "c9" and error["response"]["status_code"] == 404
    assert error["response"]["body"]["error"]["code"] == "model_not_found"
    assert await billed_requests(redis_client, redis_prefix) == 4
    await services[0].delete(TENANT, batch.input_file_id)  # free again once the batch is final


STEPS = ("in_progress", "finalizing", "output file written", "completed")


@pytest.mark.parametrize("kill_at", STEPS)
async def test_a_runner_killed_between_any_two_steps_leaves_a_batch_the_next_one_finishes(
    redis_client, redis_prefix, services, kill_at
):
    """Killed right after any transition (validating → in_progress → finalizing →
    completed) or after its output file is written, the next runner goes on from the stored
    state: each line answered once and billed once, one output file."""
    pipeline = Pipeline()
    ref = await submit(services, [line(i) for i in range(NUM_LINES)])
    files, batches = services
    first = make_runner(redis_client, services, pipeline)
    real_move, real_create = batches.move, files.create

    async def dying_move(ref, target, *args, **kwargs):
        result = await real_move(ref, target, *args, **kwargs)
        if target.value == kill_at:
            raise asyncio.CancelledError  # the process dies here
        return result

    async def dying_create(*args, **kwargs):
        record = await real_create(*args, **kwargs)
        if kill_at == "output file written":
            raise asyncio.CancelledError
        return record

    batches.move, files.create = dying_move, dying_create  # type: ignore[method-assign]
    with pytest.raises(asyncio.CancelledError):
        await first.advance(ref)
    batches.move, files.create = real_move, real_create  # type: ignore[method-assign]
    await make_runner(redis_client, services, pipeline).advance(ref)
    batch = await batches.get(ref)
    assert batch.status is BatchStatus.COMPLETED
    assert batch.counts["completed"] == NUM_LINES
    assert set(pipeline.answered.values()) == {1}  # every line answered once
    rows = await output_rows(services, batch.output_file_id)
    assert sorted(r["custom_id"] for r in rows) == sorted(f"c{i}" for i in range(NUM_LINES))
    assert await billed_requests(redis_client, redis_prefix) == NUM_LINES
    outputs, _ = await files.list(TENANT, purpose="batch_output")
    assert [f.id for f in outputs] == [batch.output_file_id]


async def test_lines_in_flight_when_a_runner_dies_run_again_and_are_billed_once(
    redis_client, redis_prefix, services
):
    dying = Pipeline(answer_only=2)  # two lines answered, the next two held in flight
    ref = await submit(services, [line(i) for i in range(NUM_LINES)])
    _, batches = services
    first = asyncio.create_task(make_runner(redis_client, services, dying).advance(ref))
    while dying.started < 4:
        await asyncio.sleep(0.01)
    first.cancel()  # dies with lines in flight: they were never recorded, nor billed
    await asyncio.gather(first, return_exceptions=True)
    assert await redis_client.hlen(batches.lines_key(ref)) == 2
    assert await billed_requests(redis_client, redis_prefix) == 2
    second = Pipeline()
    await make_runner(redis_client, services, second).advance(ref)
    batch = await batches.get(ref)
    assert batch.status is BatchStatus.COMPLETED and batch.counts["completed"] == NUM_LINES
    assert await billed_requests(redis_client, redis_prefix) == NUM_LINES
    assert sorted(dying.answered) == ["p0", "p1"]
    assert sorted(second.answered) == [f"p{i}" for i in range(2, NUM_LINES)]  # held ones again


async def test_a_lease_keeps_a_second_runner_off_until_the_first_one_is_dead(
    redis_client, services
):
    pipeline = Pipeline(delay=0.02)
    ref = await submit(services, [line(i) for i in range(NUM_LINES)])
    first = make_runner(redis_client, services, pipeline, lease_s=0.3)
    second = make_runner(redis_client, services, pipeline, lease_s=0.3)
    await first.poll()
    assert ref in first.driving
    await second.poll()
    assert ref not in second.driving
    # The first dies without a word: its task gone, its lease left to run out.
    first.driving[ref].cancel()
    await asyncio.gather(*first.driving.values(), return_exceptions=True)
    await redis_client.set(first._lease(ref), first.owner, px=300)
    await second.poll()
    assert ref not in second.driving
    await asyncio.sleep(0.35)
    await second.poll()
    await asyncio.gather(*second.driving.values())
    batch = await services[1].get(ref)
    assert batch.status is BatchStatus.COMPLETED and batch.counts["completed"] == NUM_LINES


async def test_a_failure_the_line_did_not_cause_is_retried(redis_client, services):
    pipeline = Pipeline(flaky=2)
    ref = await submit(services, [line(0)])
    await make_runner(redis_client, services, pipeline).advance(ref)
    batch = await services[1].get(ref)
    assert batch.counts == {"total": 1, "completed": 1, "failed": 0}


async def test_the_input_of_a_running_batch_cannot_be_deleted(redis_client, services):
    from gateway.errors import ConflictError

    ref = await submit(services, [line(0)])
    batch = await services[1].get(ref)
    with pytest.raises(ConflictError):
        await services[0].delete(TENANT, batch.input_file_id)


async def test_a_batch_created_on_this_replica_is_taken_without_waiting_for_a_poll(
    redis_client, services
):
    """The runner's poll is an hour: only the create's wake-up can start the batch."""
    files, batches = services
    config = RunnerConfig(max_batches=2, lines_in_flight=2, lease_s=5.0, poll_s=3600.0,
                          max_lines=100)  # fmt: skip
    pipeline = Pipeline()
    runner = BatchRunner(
        redis_client, batches=batches, files=files, resolve=pipeline.resolve,
        answer=pipeline.answer, config=config,
    )  # fmt: skip
    forever = asyncio.create_task(runner.run_forever())
    try:
        await asyncio.sleep(0.05)  # its first look found nothing: it waits out the hour
        ref = await submit(services, [line(i) for i in range(3)])
        for _ in range(2000):  # at most 10 s: without the wake-up it would wait an hour
            if (await batches.get(ref)).status is BatchStatus.COMPLETED:
                break
            await asyncio.sleep(0.005)
        batch = await batches.get(ref)
        assert batch.status is BatchStatus.COMPLETED and batch.counts["completed"] == 3
    finally:
        forever.cancel()
        await asyncio.gather(forever, return_exceptions=True)
