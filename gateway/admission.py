"""A request's quota decision, taken before its worker call or beside it.

Beside it when this gateway's last decision for the tenant left room for the request
(`QuotaService.has_room`): the decision's Redis round trip (~0.5 ms at idle, 2-5 ms on a
loaded machine, measured with ``bench.serve``'s load D) then runs while the worker
prefills instead of adding to the time to first token. The decision is the same atomic
script either way, so limits hold exactly: a request it refuses is cancelled before its
first token reaches anyone (the worker aborts it and frees its blocks) and gets its 429.
A tenant this gateway has not seen yet, or last saw refused or near a limit, is decided
first, so a tenant over its quota does not reach a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from gateway.quotas import QuotaService, Reservation
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

    async def run(self, make_work: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """``make_work()``'s result once the request is admitted: the work starts after the
        decision, or at once beside it when the tenant had room. A refusal (or a failed
        decision) cancels the work and raises."""
        if not self.quotas.has_room(self.tenant, self.tokens):
            await self.admit()
            return await make_work()
        task = asyncio.ensure_future(make_work())
        try:
            await self.admit()
        except BaseException:
            await discard(task)
            raise
        return await task


async def discard(task: asyncio.Task) -> None:
    """Cancel ``task``, or undo what it finished: a started worker stream is cancelled."""
    task.cancel()
    with contextlib.suppress(BaseException):
        if isinstance(result := await task, WorkerStream):
            result.cancel()
