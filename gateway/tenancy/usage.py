"""Usage accounting: prompt, completion and cached-prompt tokens and requests, per tenant,
per model (the base model or an adapter, by the name the client used), per UTC day.

One Redis hash per tenant and day, `{prefix}{tenant}:usage:YYYY-MM-DD`, with fields
`<model>|<counter>`; the quota settlement script increments it in the same atomic step that
refunds the request's reservation. Adapter names cannot contain `|`; the base model's name is
split at the last `|`, so it may.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, timedelta

import redis.asyncio as aioredis

from gateway.errors import InvalidRequestError

COUNTERS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")
MAX_DAYS = 366


def usage_key(prefix: str, tenant: str, day: str) -> str:
    return f"{prefix}{{{tenant}}}:usage:{day}"


@dataclass(frozen=True, slots=True)
class UsageDelta:
    """What one finished request adds to its tenant's usage."""

    model: str
    requests: int = 1
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def increments(self) -> list[str | int]:
        """`field, amount` pairs for HINCRBY, zero amounts left out."""
        pairs: list[str | int] = []
        for counter in COUNTERS:
            amount = getattr(self, counter)
            if amount:
                pairs += [f"{self.model}|{counter}", amount]
        return pairs


def day_range(start: str | None, end: str | None, *, today: date) -> list[str]:
    """The days from `start` to `end` inclusive (ISO dates; default: today)."""
    try:
        last = date.fromisoformat(end) if end else today
        first = date.fromisoformat(start) if start else last
    except ValueError as exc:
        raise InvalidRequestError(f"dates must be YYYY-MM-DD ({exc})", param="start_date") from exc
    if first > last:
        raise InvalidRequestError("start_date is after end_date", param="start_date")
    days = (last - first).days + 1
    if days > MAX_DAYS:
        raise InvalidRequestError(f"at most {MAX_DAYS} days per query", param="start_date")
    return [(first + timedelta(days=i)).isoformat() for i in range(days)]


async def read_usage(
    client: aioredis.Redis, *, prefix: str, tenants: list[str], days: list[str]
) -> list[dict]:
    """One row per (tenant, day, model) with any usage, sorted that way."""
    async with client.pipeline(transaction=False) as pipe:
        for tenant in tenants:
            for day in days:
                pipe.hgetall(usage_key(prefix, tenant, day))
        hashes = await pipe.execute()
    rows = []
    cells = iter(hashes)
    for tenant in tenants:
        for day in days:
            by_model: dict[str, dict[str, int]] = {}
            for key, value in next(cells).items():
                model, _, counter = key.rpartition("|")
                if counter in COUNTERS:
                    by_model.setdefault(model, dict.fromkeys(COUNTERS, 0))[counter] = int(value)
            for model in sorted(by_model):
                counts = by_model[model]
                total = counts["prompt_tokens"] + counts["completion_tokens"]
                rows.append(
                    {"tenant": tenant, "date": day, "model": model, **counts, "total_tokens": total}
                )
    return rows
