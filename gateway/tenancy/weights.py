"""Tenants' scheduling weights: a named tier or a weight of their own, in the tenant's
record in Redis (`tenant:{name}`: `sched_tier` or `sched_weight`, never both).

A tier is stored by name and resolved against the settings' tiers when read, so changing a
tier's weight in the settings changes every tenant on it; a tier the settings no longer name
resolves to the default tier (logged). Requests read weights from a per-tenant cache
renewed in the background, as API keys are, so no request waits for Redis for it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import re
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
import redis.exceptions

from gateway import metrics
from gateway.errors import InvalidRequestError

log = logging.getLogger(__name__)

# Weights are relative; the bounds keep one tenant's share and the counters' arithmetic sane,
# and are the engine's (worker.core.fairness): a weight travels as a float32, so a tiny one would
# round to 0, which the worker reads as unset.
MIN_WEIGHT = 0.001
MAX_WEIGHT = 1000.0
TIER_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
TIER_FIELD = "sched_tier"
WEIGHT_FIELD = "sched_weight"
MAX_CACHED_TENANTS = 100_000


class WeightSource(enum.StrEnum):
    TIER = "tier"  # the tenant's tier
    WEIGHT = "weight"  # a weight of its own
    DEFAULT = "default"  # neither (or a tier the settings no longer name): the default tier


@dataclass(frozen=True, slots=True)
class WeightAssignment:
    """A tenant's resolved scheduling: what it has set, and the weight that follows."""

    tier: str | None
    weight: float
    source: WeightSource


def check_weight(weight: float, *, param: str = "weight") -> float:
    if not (math.isfinite(weight) and MIN_WEIGHT <= weight <= MAX_WEIGHT):
        raise InvalidRequestError(
            f"weight must be a finite number in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}], got {weight!r}",
            param=param,
        )
    return float(weight)


def check_tiers(tiers: dict[str, float], *, default: str) -> None:
    """The settings' tiers: valid names, weights in [MIN_WEIGHT, MAX_WEIGHT], the default
    among them."""
    for name, weight in tiers.items():
        if not TIER_NAME.match(name):
            raise ValueError(f"scheduling tier name {name!r}: 1-32 of a-z, 0-9, '-', '_'")
        if not (math.isfinite(weight) and MIN_WEIGHT <= weight <= MAX_WEIGHT):
            raise ValueError(
                f"scheduling tier {name!r}: weight must be in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}]"
            )
    if default not in tiers:
        raise ValueError(
            f"SWITCHBOARD_DEFAULT_SCHEDULING_TIER {default!r} is not one of the tiers "
            f"{sorted(tiers)}"
        )


class TenantWeights:
    """Reads and writes tenants' scheduling; `weight` answers requests from a cache."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str,
        tiers: dict[str, float],
        default_tier: str,
        cache_s: float,
    ) -> None:
        check_tiers(tiers, default=default_tier)
        self.redis = client
        self.prefix = prefix
        self.tiers = dict(tiers)
        self.default_tier = default_tier
        self.cache_s = cache_s
        self._cached: dict[str, tuple[float, float]] = {}  # tenant -> (weight, expiry)
        self._rechecks: dict[str, asyncio.Task] = {}
        # Bumped by every change made here: a read that began before one does not cache what
        # it read (it may predate the change).
        self._epoch = 0

    @property
    def default_weight(self) -> float:
        return self.tiers[self.default_tier]

    def _k(self, tenant: str) -> str:
        return f"{self.prefix}tenant:{tenant}"  # the tenant's record (gateway.tenancy.tenants)

    async def set_tier(self, tenant: str, tier: str) -> WeightAssignment:
        if tier not in self.tiers:
            raise InvalidRequestError(
                f"unknown tier {tier!r}; the tiers are {', '.join(sorted(self.tiers))}",
                param="tier",
            )
        return await self._store(tenant, TIER_FIELD, tier, drop=WEIGHT_FIELD)

    async def set_weight(self, tenant: str, weight: float) -> WeightAssignment:
        return await self._store(tenant, WEIGHT_FIELD, repr(check_weight(weight)), drop=TIER_FIELD)

    async def reset(self, tenant: str) -> WeightAssignment:
        """Back to the default tier."""
        await self.redis.hdel(self._k(tenant), TIER_FIELD, WEIGHT_FIELD)
        self._forget(tenant)
        return self.resolve(None, None)

    async def _store(self, tenant: str, field: str, value: str, *, drop: str) -> WeightAssignment:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._k(tenant), field, value)
            pipe.hdel(self._k(tenant), drop)
            await pipe.execute()
        self._forget(tenant)
        return await self.get(tenant)

    def _forget(self, tenant: str) -> None:
        """A change made here applies to this gateway's next request."""
        self._epoch += 1
        self._cached.pop(tenant, None)

    async def get(self, tenant: str) -> WeightAssignment:
        """The tenant's scheduling as Redis holds it now."""
        tier, weight = await self.redis.hmget(self._k(tenant), [TIER_FIELD, WEIGHT_FIELD])
        return self.resolve(tier, weight)

    def resolve(self, tier: str | None, weight: str | None) -> WeightAssignment:
        if weight is not None:
            return WeightAssignment(tier=None, weight=float(weight), source=WeightSource.WEIGHT)
        if tier is not None and tier in self.tiers:
            return WeightAssignment(tier=tier, weight=self.tiers[tier], source=WeightSource.TIER)
        if tier is not None:
            log.warning("tier %r is not in the settings' tiers: the default applies", tier)
        return WeightAssignment(tier=tier, weight=self.default_weight, source=WeightSource.DEFAULT)

    async def weight(self, tenant: str) -> float:
        """The tenant's weight for a request: cached for ``cache_s``, renewed off the
        request's path past half of it. If Redis fails, the last known weight (or the
        default) serves, logged and counted: a weight is a share, never a permission."""
        now = time.monotonic()
        known = self._cached.get(tenant)
        if known is not None and known[1] > now:
            if known[1] - now < self.cache_s / 2 and tenant not in self._rechecks:
                recheck = asyncio.create_task(self._read(tenant, fallback=known[0]))
                self._rechecks[tenant] = recheck
                recheck.add_done_callback(lambda _: self._rechecks.pop(tenant, None))
            return known[0]
        return await self._read(tenant, fallback=known[0] if known else self.default_weight)

    async def _read(self, tenant: str, *, fallback: float) -> float:
        epoch = self._epoch
        try:
            weight = (await self.get(tenant)).weight
        except redis.exceptions.RedisError as exc:
            metrics.SCHEDULING_LOOKUP_ERRORS.inc()
            log.warning("reading %s's weight failed (using %g): %r", tenant, fallback, exc)
            weight = fallback  # cached too: requests do not each wait for a Redis that is down
        if self.cache_s > 0 and epoch == self._epoch:
            if len(self._cached) >= MAX_CACHED_TENANTS:
                self._cached.clear()
            self._cached[tenant] = (weight, time.monotonic() + self.cache_s)
        return weight
