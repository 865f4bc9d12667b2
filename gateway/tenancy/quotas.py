"""Per-tenant quotas: requests and tokens per minute, concurrent requests, a daily token
budget. One atomic Lua script per decision (`gateway.tenancy.quota_scripts`), so they hold exactly
across gateway replicas.

A request reserves prompt tokens + n * max_tokens at admission; when it ends, `settle`
refunds what it did not use, releases its concurrency slot and counts its usage. While it
runs, a task renews its slot's lease; if the gateway dies, the lease expires and the slot
comes back by itself.

When Redis fails at admission, `fail_open` decides: refuse (503, the default) or admit
unmetered. Either way it is logged and counted in a metric, never silently absorbed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

import redis.asyncio as aioredis
import redis.exceptions

from gateway import metrics
from gateway.errors import RateLimitError, StateUnavailableError
from gateway.tenancy.quota_scripts import ADMIT, PEEK, RENEW, SETTLE
from gateway.tenancy.script_batch import ScriptBatcher
from gateway.tenancy.usage import UsageDelta, usage_key

log = logging.getLogger(__name__)

WINDOW_MS = 60_000
DAILY_KEY_TTL_S = 2 * 86400
USAGE_TTL_S = 400 * 86400
QUOTA_FIELDS = {  # Quota attribute → field in the quota hash
    "requests_per_minute": "rpm",
    "tokens_per_minute": "tpm",
    "max_concurrent_requests": "concurrency",
    "daily_tokens": "daily_tokens",
    # Adapter storage, checked by the upload's registration script
    # (gateway.uploads.catalog_scripts); unset, the settings' defaults apply (never unlimited: the
    # store is shared).
    "max_adapters": "max_adapters",
    "max_adapter_bytes": "max_adapter_bytes",
}


@dataclass(frozen=True, slots=True)
class Quota:
    """A tenant's limits; None means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    daily_tokens: int | None = None
    max_adapters: int | None = None  # None: the gateway's default_max_adapters
    max_adapter_bytes: int | None = None  # None: default_max_adapter_storage_bytes


@dataclass(frozen=True, slots=True)
class QuotaUse:
    """How much of each per-minute, concurrency and daily limit is in use now."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    daily_tokens: int | None = None


@dataclass(slots=True)
class Reservation:
    """An admitted request's claim on its tenant's quotas, until `QuotaService.settle`."""

    tenant: str
    request_id: str
    tokens: int
    day: str  # the daily-budget key's day: the refund goes to the day that was charged
    daily_charged: bool
    metered: bool  # False when admitted unmetered because Redis failed (fail open)
    headers: dict[str, str] = field(default_factory=dict)
    renewal: asyncio.Task | None = None
    settled: bool = False


def tenant_key(prefix: str, tenant: str, name: str) -> str:
    """`{prefix}{tenant}:name`: the hash tag keeps a tenant's keys in one Cluster slot."""
    return f"{prefix}{{{tenant}}}:{name}"


def utc_day(now: datetime | None = None) -> str:
    if now is not None:
        return now.strftime("%Y-%m-%d")
    # Formatted once a day, not twice a request (strftime is ~1% of the gateway's CPU):
    # Unix time has exactly 86,400 seconds in every UTC day.
    global _today
    number = int(time.time() // 86400)
    if _today[0] != number:
        _today = (number, datetime.fromtimestamp(number * 86400, UTC).strftime("%Y-%m-%d"))
    return _today[1]


_today: tuple[int, str] = (-1, "")


class QuotaService:
    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str,
        lease_s: float,
        fail_open: bool,
        window_ms: int = WINDOW_MS,  # "per minute"; shorter only to test expiry quickly
    ) -> None:
        self.redis = client
        self.prefix = prefix
        self.window_ms = window_ms
        self.lease_ms = max(1, int(lease_s * 1000))
        self.fail_open = fail_open
        self._admit = client.register_script(ADMIT)
        self._settle = client.register_script(SETTLE)
        self._renew = client.register_script(RENEW)
        self._peek = client.register_script(PEEK)
        self._scripts = ScriptBatcher(client)
        self._room: dict[str, Room] = {}  # tenant -> what its last decision here left

    async def close(self) -> None:
        await self._scripts.close()

    def _k(self, tenant: str, name: str) -> str:
        return tenant_key(self.prefix, tenant, name)

    async def set_quota(self, tenant: str, quota: Quota) -> None:
        """Replace the tenant's limits; fields left None become unlimited."""
        values = {QUOTA_FIELDS[k]: v for k, v in asdict(quota).items() if v is not None}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._k(tenant, "quota"))
            if values:
                pipe.hset(self._k(tenant, "quota"), mapping=values)
            await pipe.execute()

    async def get_quota(self, tenant: str) -> Quota:
        raw = await self.redis.hgetall(self._k(tenant, "quota"))
        return Quota(**{k: int(raw[f]) for k, f in QUOTA_FIELDS.items() if f in raw})

    async def usage_now(self, tenant: str) -> QuotaUse:
        """What the tenant's limited windows hold now, as the next admission would count it
        (None for a limit it does not have); reads only."""
        quota = await self.get_quota(tenant)
        names = ["requests", "tokens", "tokens_total", "inflight", f"daily:{utc_day()}"]
        reply = await self._peek(keys=[self._k(tenant, n) for n in names], args=[self.window_ms])
        requests, tokens, running, daily = (int(n) for n in reply)
        return QuotaUse(
            requests_per_minute=requests if quota.requests_per_minute is not None else None,
            tokens_per_minute=tokens if quota.tokens_per_minute is not None else None,
            max_concurrent_requests=running if quota.max_concurrent_requests is not None else None,
            daily_tokens=daily if quota.daily_tokens is not None else None,
        )

    async def admit(self, tenant: str, *, request_id: str, tokens: int) -> Reservation:
        """Reserve `tokens` for a request, or raise RateLimitError (429)."""
        day = utc_day()
        keys = [
            self._k(tenant, "quota"),
            self._k(tenant, "requests"),
            self._k(tenant, "tokens"),
            self._k(tenant, "tokens_total"),
            self._k(tenant, "inflight"),
            self._k(tenant, f"daily:{day}"),
        ]
        args = [request_id, tokens, self.lease_ms, self.window_ms, DAILY_KEY_TTL_S]
        try:
            reply = await self._scripts.run(self._admit, keys=keys, args=args)
        except redis.exceptions.RedisError as exc:
            return self._redis_failed(exc, tenant=tenant, request_id=request_id, day=day)
        decision = Decision.from_reply(reply, tokens=tokens)
        if not decision.admitted:
            self._room.pop(tenant, None)
            metrics.QUOTA_REJECTIONS.labels(tenant=tenant, reason=decision.reason).inc()
            raise decision.error(tenant)
        self._room[tenant] = decision.room()
        reservation = Reservation(
            tenant=tenant,
            request_id=request_id,
            tokens=tokens,
            day=day,
            daily_charged=decision.daily >= 0,
            metered=True,
            headers=decision.headers(),
        )
        if decision.concurrency >= 0:
            reservation.renewal = asyncio.create_task(self._keep_leased(reservation))
        return reservation

    def take_room(self, tenant: str, tokens: int) -> bool:
        """Whether this gateway's last decision for ``tenant`` admitted it and left room for
        one more request of ``tokens``; if so, that room shrinks by it. A hint only, for
        starting work beside the decision (`gateway.admission`): other gateways and ended
        requests change the truth, which only `admit` tells."""
        room = self._room.get(tenant)
        if room is None or min(room.requests, room.slots) < 1:
            return False
        if min(room.tokens, room.daily) < tokens:
            return False
        room.requests -= 1
        room.slots -= 1
        room.tokens -= tokens
        room.daily -= tokens
        return True

    def _redis_failed(
        self, exc: Exception, *, tenant: str, request_id: str, day: str
    ) -> Reservation:
        outcome = "admitted" if self.fail_open else "refused"
        metrics.QUOTA_REDIS_ERRORS.labels(outcome=outcome).inc()
        log.error("quota check failed for %s (%s, fail %s): %r", tenant, request_id, outcome, exc)
        if not self.fail_open:
            raise StateUnavailableError("quota state (Redis) is unavailable; retry later") from exc
        return Reservation(
            tenant=tenant, request_id=request_id, tokens=0, day=day, daily_charged=False,
            metered=False,
        )  # fmt: skip

    async def renew(self, reservation: Reservation) -> bool:
        """Extend the request's concurrency lease; False once it is gone (settled or
        expired): a late renewal never brings a released slot back."""
        key = self._k(reservation.tenant, "inflight")
        args = [reservation.request_id, self.lease_ms]
        return bool(await self._scripts.run(self._renew, keys=[key], args=args))

    async def _keep_leased(self, reservation: Reservation) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            try:
                alive = await self.renew(reservation)
            except redis.exceptions.RedisError as exc:
                metrics.QUOTA_REDIS_ERRORS.labels(outcome="renew_failed").inc()
                log.warning("lease renewal failed for %s: %r", reservation.request_id, exc)
                continue
            if not alive:  # expired (Redis was out of reach longer than a lease) or settled
                log.warning("the lease of %s is gone; not renewing it", reservation.request_id)
                return

    async def settle(
        self, reservation: Reservation, *, used_tokens: int, usage: UsageDelta
    ) -> None:
        """Refund the unused tokens, release the slot, count usage. Idempotent; never raises
        (the response is already on its way): failures are logged and counted."""
        if reservation.settled:
            return
        reservation.settled = True
        if reservation.renewal is not None:
            reservation.renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reservation.renewal
        tenant = reservation.tenant
        keys = [
            self._k(tenant, "tokens"),
            self._k(tenant, "tokens_total"),
            self._k(tenant, "inflight"),
            self._k(tenant, f"daily:{reservation.day}"),
            usage_key(self.prefix, tenant, utc_day()),
        ]
        reserved = reservation.tokens if reservation.metered else used_tokens
        args: list[str | int] = [
            reservation.request_id,
            reserved,
            min(used_tokens, reserved),
            "1" if reservation.daily_charged else "0",
            USAGE_TTL_S,
            *usage.increments(),
        ]
        try:
            await self._scripts.run(self._settle, keys=keys, args=args)
        except redis.exceptions.RedisError as exc:
            metrics.QUOTA_REDIS_ERRORS.labels(outcome="settle_failed").inc()
            log.error("settling %s failed (its lease will expire): %r", reservation.request_id, exc)


@dataclass(slots=True)
class Room:
    """What an admitted request left of its tenant's limits (infinite where unlimited)."""

    requests: float
    slots: float
    tokens: float
    daily: float


@dataclass(frozen=True, slots=True)
class Decision:
    """The admission script's answer (see ADMIT's Returns)."""

    admitted: bool
    reason: str
    rpm: int
    requests_used: int
    request_reset_ms: int
    tpm: int
    tokens_used: int
    token_reset_ms: int
    retry_ms: int
    concurrency: int
    running: int
    daily: int
    daily_used: int
    tokens: int  # what this request asked for

    @classmethod
    def from_reply(cls, reply: list, *, tokens: int) -> Decision:
        admitted, reason, *numbers = reply
        return cls(bool(admitted), str(reason), *(int(n) for n in numbers), tokens=tokens)

    def room(self) -> Room:
        """What is left after this (admitted) request; the script reports -1 for no limit."""

        def left(limit: int, used: int) -> float:
            return math.inf if limit < 0 else limit - used

        return Room(
            requests=left(self.rpm, self.requests_used + 1),
            slots=left(self.concurrency, self.running + 1),
            tokens=left(self.tpm, self.tokens_used + self.tokens),
            daily=left(self.daily, self.daily_used + self.tokens),
        )

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers, for the limits this tenant has."""
        headers = {}
        this = 1 if self.admitted else 0
        if self.rpm >= 0:
            headers["x-ratelimit-limit-requests"] = str(self.rpm)
            remaining = max(0, self.rpm - self.requests_used - this)
            headers["x-ratelimit-remaining-requests"] = str(remaining)
            headers["x-ratelimit-reset-requests"] = duration(self.request_reset_ms)
        if self.tpm >= 0:
            headers["x-ratelimit-limit-tokens"] = str(self.tpm)
            remaining = max(0, self.tpm - self.tokens_used - this * self.tokens)
            headers["x-ratelimit-remaining-tokens"] = str(remaining)
            headers["x-ratelimit-reset-tokens"] = duration(self.token_reset_ms)
        return headers

    def error(self, tenant: str) -> RateLimitError:
        headers = self.headers()
        wait = f" Please try again in {duration(self.retry_ms)}." if self.retry_ms else ""
        if self.reason == "too_large":
            headers["x-should-retry"] = "false"  # the official clients honour it
            message = (
                f"Request too large for tokens per minute (TPM): Limit {self.tpm}, Requested "
                f"{self.tokens} (prompt + max_tokens x n). Reduce the prompt or max_tokens."
            )
            return RateLimitError(message, kind="tokens", headers=headers)
        headers["retry-after"] = str(max(1, math.ceil(self.retry_ms / 1000)))
        headers["retry-after-ms"] = str(self.retry_ms)
        if self.reason == "concurrency":
            message = (
                f"Too many concurrent requests for tenant {tenant}: Limit "
                f"{self.concurrency}, Running {self.running}.{wait}"
            )
            return RateLimitError(message, kind="requests", headers=headers)
        if self.reason == "requests":
            message = (
                f"Rate limit reached for requests per minute (RPM) for tenant {tenant}: Limit "
                f"{self.rpm}, Used {self.requests_used}, Requested 1.{wait}"
            )
            return RateLimitError(message, kind="requests", headers=headers)
        if self.reason == "tokens":
            message = (
                f"Rate limit reached for tokens per minute (TPM) for tenant {tenant}: Limit "
                f"{self.tpm}, Used {self.tokens_used}, Requested {self.tokens}.{wait}"
            )
            return RateLimitError(message, kind="tokens", headers=headers)
        message = (
            f"Daily token budget exhausted for tenant {tenant}: Limit {self.daily}, Used "
            f"{self.daily_used}, Requested {self.tokens}. It resets at 00:00 UTC.{wait}"
        )
        return RateLimitError(message, kind="insufficient_quota", headers=headers)


def duration(ms: int) -> str:
    """OpenAI's reset format: `20ms`, `1s`, `6.5s`, `1m0s`."""
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest_ms = divmod(ms, 60_000)
    seconds = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"
