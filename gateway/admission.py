"""A request's quota decision, taken before its worker call or beside it.

Beside it when this gateway's last decision for the tenant left room for the request
(`QuotaService.take_room`): the decision's Redis round trip (several times longer on a
loaded machine than at idle: docs/performance.md) then runs while the worker prefills
instead of adding to the time to first token. The decision is the same atomic
script either way, so limits hold exactly: a request it refuses is cancelled before its
first token reaches anyone (the worker aborts it and frees its blocks) and gets its 429.
A tenant this gateway has not seen yet, or last saw refused or near a limit, is decided
first, so a tenant over its quota does not reach a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gateway.interrupts import Interrupt
from gateway.tenancy.quotas import QuotaService, Reservation
from gateway.worker_client import WorkerStream

T = TypeVar("T")


class Admission:
    def __init__(self, quotas: QuotaService, tenant: str, *, request_id: str, tokens: int):
        self.quotas = quotas
        self.tenant = tenant
        self.request_id = request_id
        self.tokens = tokens
        self.reservation: Reservation | None = None  # once admitted: settle it at the end

    @property
    def headers(self) -> dict[str, str]:
        return self.reservation.headers if self.reservation is not None else {}

    async def admit(self) -> None:
        self.reservation = await self.quotas.admit(
            self.tenant, request_id=self.request_id, tokens=self.tokens
        )

    async def run(self, make_work: Callable[[], Awaitable[T]]) -> T:
        """``make_work()``'s result once the request is admitted: the work starts after the
        decision, or at once beside it when the tenant had room. A refusal (or a failed
        decision) undoes the work and raises; it outranks the work's own failure, as it
        would have had it come first."""
        if not self.quotas.take_room(self.tenant, self.tokens):
            await self.admit()
            return await make_work()
        # The decision on a task of its own, the work on the caller's, so the caller resumes
        # straight from the worker's answer (a task hop more is latency under load); a
        # refusal interrupts the caller's await.
        deciding = asyncio.ensure_future(self.admit())
        refusal = Interrupt(deciding, lambda decision: decision.exception() is not None)
        try:
            with refusal:
                result = await make_work()
        except asyncio.CancelledError:
            if refusal.fired:
                raise deciding.exception() from None
            with contextlib.suppress(Exception):  # the client left: the decision still lands,
                await deciding  # and an admitted request's reservation is then settled
            raise
        except Exception as failure:
            try:
                await deciding
            except Exception as refused:
                raise refused from failure
            raise
        try:
            await deciding
        except BaseException:
            if isinstance(result, WorkerStream):
                result.cancel()  # the started call: the worker aborts it
            raise
        return result
