"""The runner: drives batches from state to state, in every gateway replica.

Each replica looks for active batches nobody drives and takes one under a lease in Redis
(`…:batch:<id>:lease`, a TTL renewed by a heartbeat every third of it). A replica that dies
stops renewing; once its lease runs out another replica takes the batch over and goes on from
the stored state (`gateway.batch.states`), whose work is idempotent:

- validating: read the input file (a broken file fails the batch, naming its lines);
- in_progress: run every line not yet recorded, a bounded number at once, through the request
  pipeline in the batch band (`gateway.pipeline.resolve_line` / `answer_line`); each result
  is recorded once with its billing (`gateway.batch.lines`). A line a dying runner had in
  flight runs again elsewhere (its first run was never billed). A failure the line did not
  cause (no worker, a full queue, a worker that failed) is retried until the window ends;
- past `expires_at`: lines still running are stopped, every unfinished line gets an
  `batch_expired` error line, the files are written: `expired`;
- finalizing / cancelling: the output and error files are written (their ids derived from the
  batch's, so writing twice makes one file each), then `completed` / `cancelled`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import redis.exceptions

from gateway.batch.batches import Batch, BatchRef, BatchService
from gateway.batch.files import OUTPUT_PURPOSE, FileService
from gateway.batch.lines import (
    InputLine,
    Kind,
    LineError,
    LineRecorder,
    error_line,
    expired_line,
    output_line,
    read_input,
    request_of,
    stored_text,
)
from gateway.batch.states import BatchStatus, TransitionRefused
from gateway.errors import GatewayError, NotFoundError
from gateway.job import Job
from gateway.parsing import OpenAIRequest
from gateway.tally import Tally
from gateway.tenancy.usage import UsageDelta

log = logging.getLogger(__name__)

# A line that failed for a reason it did not cause waits this long before it runs again
# (doubling up to the cap).
RETRY_FIRST_S = 0.5
RETRY_CAP_S = 30.0
RETRYABLE = frozenset({429, 499, 500, 502, 503, 504})

# KEYS: 1 lease; ARGV: 1 owner, 2 ms. Renews (or releases, with ms 0) only our own lease.
RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) == 0 then redis.call('DEL', KEYS[1]) else
  redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""

Resolve = Callable[[str, OpenAIRequest], Awaitable[Job]]
Answer = Callable[[OpenAIRequest, Job, Tally], Awaitable[dict]]


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    max_batches: int  # driven at once by this replica
    lines_in_flight: int  # per batch
    lease_s: float
    poll_s: float
    max_lines: int


class _Stopped(Exception):
    """The batch left in_progress (cancelled) or its window ended, while lines ran."""


class BatchRunner:
    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        batches: BatchService,
        files: FileService,
        resolve: Resolve,
        answer: Answer,
        config: RunnerConfig,
    ) -> None:
        self.redis = redis
        self.batches = batches
        self.files = files
        self.recorder = LineRecorder(redis, prefix=batches.prefix)
        self.resolve = resolve
        self.answer = answer
        self.config = config
        self.owner = uuid.uuid4().hex
        self.driving: dict[BatchRef, asyncio.Task] = {}
        # Why a batch's running lines are being stopped: they record themselves as this.
        self._stopping: dict[BatchRef, BatchStatus] = {}
        self._renew = redis.register_script(RENEW)

    # -- finding work -------------------------------------------------------------------------

    async def run_forever(self) -> None:
        """Claim and drive batches until cancelled (the gateway's shutdown): every `poll_s`,
        and at once when this replica creates one."""
        try:
            while True:
                self.batches.created.clear()
                try:
                    await self.poll()
                except redis.exceptions.RedisError as exc:
                    log.warning("batch runner: Redis failed (%r); retrying", exc)
                with contextlib.suppress(TimeoutError):  # a batch created here: look now
                    await asyncio.wait_for(self.batches.created.wait(), self.config.poll_s)
        finally:
            for task in self.driving.values():
                task.cancel()
            await asyncio.gather(*self.driving.values(), return_exceptions=True)

    async def poll(self) -> None:
        """One look: expired files swept, and active batches nobody drives taken (up to
        `max_batches`), tenants this runner drives no batch of first, so one tenant's many
        batches do not take every runner's slots."""
        await self.files.sweep_expired()
        driven = {ref.tenant for ref in self.driving}
        found = sorted(await self.batches.active(), key=lambda r: (r.tenant in driven, r.member))
        for ref in found:
            if len(self.driving) >= self.config.max_batches:
                return
            if ref in self.driving:
                continue
            if await self.redis.set(self._lease(ref), self.owner, nx=True, px=self._lease_ms):
                task = asyncio.create_task(self._drive(ref))
                self.driving[ref] = task
                task.add_done_callback(lambda _, ref=ref: self.driving.pop(ref, None))

    @property
    def _lease_ms(self) -> int:
        return max(1, int(self.config.lease_s * 1000))

    def _lease(self, ref: BatchRef) -> str:
        return self.batches.key(ref, ":lease")

    async def _drive(self, ref: BatchRef) -> None:
        driver = asyncio.current_task()
        assert driver is not None
        heartbeat = asyncio.create_task(self._keep_lease(ref, driver))
        try:
            await self.advance(ref)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s: the runner failed; another look will take it again", ref)
        finally:
            heartbeat.cancel()
            with contextlib.suppress(Exception):
                await self._renew(keys=[self._lease(ref)], args=[self.owner, 0])

    async def _keep_lease(self, ref: BatchRef, driver: asyncio.Task) -> None:
        """Renew the lease every third of it; once it is another's (we stalled past it),
        stop driving: the other runner goes on from the stored state."""
        while True:
            await asyncio.sleep(self.config.lease_s / 3)
            try:
                held = await self._renew(keys=[self._lease(ref)], args=[self.owner, self._lease_ms])
            except redis.exceptions.RedisError as exc:
                log.warning("batch %s: lease renewal failed (%r)", ref, exc)
                continue
            if not held:
                log.warning("batch %s: lease lost; leaving it to its new runner", ref)
                driver.cancel()
                return

    # -- the states ---------------------------------------------------------------------------

    async def advance(self, ref: BatchRef) -> None:
        """Take the batch from its stored state to a final one."""
        while True:
            try:
                batch = await self.batches.get(ref)
            except NotFoundError:
                await self.redis.srem(self.batches.machine.active_key, ref.member)
                return
            try:
                match batch.status:
                    case BatchStatus.VALIDATING:
                        await self._validate(ref, batch)
                    case BatchStatus.IN_PROGRESS:
                        await self._run_lines(ref, batch)
                    case BatchStatus.FINALIZING:
                        await self._close(ref, batch, BatchStatus.COMPLETED)
                    case BatchStatus.CANCELLING:
                        await self._close(ref, batch, BatchStatus.CANCELLED)
                    case _:  # final, left in the active set by a process that died
                        await self.redis.srem(self.batches.machine.active_key, ref.member)
                        return
            except TransitionRefused:
                continue  # moved meanwhile (a cancel): act on the new state

    async def _validate(self, ref: BatchRef, batch: Batch) -> None:
        found = await self._input(ref, batch)
        if found and isinstance(found[0], LineError):
            errors = [e.to_openai() for e in found if isinstance(e, LineError)]
            await self.batches.move(ref, BatchStatus.FAILED, {"errors": json.dumps(errors)})
            await self.files.mark_in_use(ref.tenant, batch.input_file_id, None)
            return
        await self.batches.move(ref, BatchStatus.IN_PROGRESS, {"total": len(found)})

    async def _input(self, ref: BatchRef, batch: Batch) -> list[InputLine] | list[LineError]:
        try:
            data = await self.files.read(ref.tenant, batch.input_file_id)
        except NotFoundError:
            message = f"the input file {batch.input_file_id} is gone (deleted or expired)"
            return [LineError(1, "file_not_found", message, "input_file_id")]
        return read_input(data, endpoint=batch.endpoint, max_lines=self.config.max_lines)

    async def _run_lines(self, ref: BatchRef, batch: Batch) -> None:
        found = await self._input(ref, batch)
        lines = [x for x in found if isinstance(x, InputLine)]
        done = {int(i) for i in await self.redis.hkeys(self.batches.lines_key(ref))}
        pending = [line for line in lines if line.index not in done]
        work = asyncio.create_task(self._run_all(ref, batch, pending))
        stop: BatchStatus | None = None
        try:
            while not work.done():
                await asyncio.wait({work}, timeout=self.config.poll_s)
                if work.done():
                    break
                stop = await self._stop_reason(ref, batch)
                if stop is not None:
                    self._stopping[ref] = stop
                    work.cancel()
                    await asyncio.gather(work, return_exceptions=True)
        finally:
            if not work.done():  # we are cancelled (lease lost, shutdown): lines run again
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            self._stopping.pop(ref, None)
        if stop is BatchStatus.EXPIRED:
            await self._expire(ref, batch, lines)
        elif stop is None:
            work.result()
            await self.batches.move(ref, BatchStatus.FINALIZING)
        # cancelling: `advance` closes it from its new state

    async def _stop_reason(self, ref: BatchRef, batch: Batch) -> BatchStatus | None:
        if time.time() >= batch.expires_at:
            return BatchStatus.EXPIRED
        status = await self.batches.status(ref)
        return None if status is BatchStatus.IN_PROGRESS else status

    async def _run_all(self, ref: BatchRef, batch: Batch, pending: list[InputLine]) -> None:
        slots = asyncio.Semaphore(self.config.lines_in_flight)

        async def one(line: InputLine) -> None:
            try:
                await self._line(ref, batch, line)
            finally:
                slots.release()

        async with asyncio.TaskGroup() as group:
            for line in pending:
                await slots.acquire()
                group.create_task(one(line))

    async def _line(self, ref: BatchRef, batch: Batch, line: InputLine) -> None:
        """Run one line until it has a result (retrying what it did not cause), then record
        it with its billing; a line stopped by its batch's cancel or expiry is recorded as
        that, billed for what its worker generated."""
        wait_s = RETRY_FIRST_S
        while True:
            tally = Tally()
            job: Job | None = None
            try:
                body = request_of(line, batch.endpoint)
                job = await self.resolve(ref.tenant, body)
                answer = await self.answer(body, job, tally)
                await self._record(ref, line, Kind.OUTPUT, output_line(
                    line, request_id=job.request_id, body=answer), job, tally)  # fmt: skip
                return
            except GatewayError as error:
                if error.status in RETRYABLE:
                    log.info("batch %s line %d: %s; retrying", ref, line.index, error.message)
                    await asyncio.sleep(wait_s)
                    wait_s = min(2 * wait_s, RETRY_CAP_S)
                    continue
                request_id = job.request_id if job else f"batchreq-{line.index}"
                out = error_line(line, request_id=request_id, error=error)
                await self._record(ref, line, Kind.ERROR, out, job, tally)
                return
            except asyncio.CancelledError:
                reason = self._stopping.get(ref)
                if reason is not None:  # the batch's own stop: recorded as such, billed
                    kind, out = (
                        (Kind.ERROR, expired_line(line))
                        if reason is BatchStatus.EXPIRED
                        else (Kind.CANCELLED, None)
                    )
                    await asyncio.shield(self._record(ref, line, kind, out, job, tally))
                raise

    async def _record(
        self, ref: BatchRef, line: InputLine, kind: str, out: dict | None, job: Job | None,
        tally: Tally,
    ) -> None:  # fmt: skip
        usage = None
        if job is not None and tally.started:
            usage = UsageDelta(
                model=job.model,
                prompt_tokens=len(job.prompt_ids),
                completion_tokens=tally.completion_tokens,
                cached_tokens=tally.cached_tokens,
            )
        await self.recorder.record(
            tenant=ref.tenant,
            lines_key=self.batches.lines_key(ref),
            batch_key=self.batches.key(ref),
            index=line.index,
            kind=kind,
            line=out,
            usage=usage,
        )

    async def _expire(self, ref: BatchRef, batch: Batch, lines: list[InputLine]) -> None:
        done = {int(i) for i in await self.redis.hkeys(self.batches.lines_key(ref))}
        for line in lines:
            if line.index not in done:
                await self._record(ref, line, Kind.ERROR, expired_line(line), None, Tally())
        await self._close(ref, batch, BatchStatus.EXPIRED)

    async def _close(self, ref: BatchRef, batch: Batch, target: BatchStatus) -> None:
        """Write the output and error files from the recorded lines, then ``target``."""
        stored = await self.redis.hgetall(self.batches.lines_key(ref))
        outputs: list[str] = []
        errors: list[str] = []
        for index in sorted(stored, key=int):
            kind, text = stored_text(stored[index])
            if text and kind in (Kind.OUTPUT, Kind.ERROR):  # JSON as recorded, not re-encoded
                (outputs if kind == Kind.OUTPUT else errors).append(text)
        fields: dict[str, str | int] = {}
        for name, rows in (("output", outputs), ("error", errors)):
            if rows:
                record = await self.files.create(
                    ref.tenant,
                    source=io.BytesIO(("\n".join(rows) + "\n").encode()),
                    filename=f"{batch.id}_{name}.jsonl",
                    purpose=OUTPUT_PURPOSE,
                    expires_after_s=batch.output_expires_after_s,
                    file_id=_derived_file_id(batch.id, name),
                )
                fields[f"{name}_file_id"] = record.id
        await self.batches.move(ref, target, fields)
        await self.files.mark_in_use(ref.tenant, batch.input_file_id, None)


def _derived_file_id(batch_id: str, name: str) -> str:
    return "file-" + hashlib.blake2b(f"{batch_id}\0{name}".encode(), digest_size=12).hexdigest()
