"""Settle: however a request ended (finished, failed, client gone), count it once with its
final status, hand its worker slot to the next request in fair order, and settle its quota
reservation with what it used: its prompt once a worker processed it, and every token the
worker generated (`Tally`), in usage and in the quota windows alike."""

from __future__ import annotations

import asyncio

from gateway.admission import Admission
from gateway.fair_queue import FairQueue
from gateway.job import Job
from gateway.metrics import RequestObservation
from gateway.tally import Tally
from gateway.tenancy.quotas import QuotaService
from gateway.tenancy.usage import UsageDelta


async def settle(
    job: Job,
    tally: Tally,
    *,
    admission: Admission,
    observation: RequestObservation,
    queue: FairQueue,
    quotas: QuotaService,
) -> None:
    """Idempotent: a request whose response ended and then failed is settled once."""
    observation.finish(tally.status)  # a no-op if a failure was counted first
    prompt_tokens = len(job.prompt_ids) if tally.started else 0
    used = prompt_tokens + tally.completion_tokens
    if tally.grant is not None:  # its worker slot: to the next request in fair order
        queue.release(tally.grant, used_tokens=used)
    reservation = admission.reservation
    if reservation is None:
        return  # refused, or never decided: nothing reserved
    usage = UsageDelta(
        model=job.model,
        prompt_tokens=prompt_tokens,
        completion_tokens=tally.completion_tokens,
        cached_tokens=tally.cached_tokens,
    )
    # Shielded: a cancelled request (server shutdown) still gives its slot back.
    await asyncio.shield(quotas.settle(reservation, used_tokens=used, usage=usage))
