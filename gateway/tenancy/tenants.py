"""Tenants, API keys and tenant-scoped adapter names, in Redis.

A key is `sk-` + 32 random bytes (urlsafe base64), shown once at creation. Redis holds only
its sha256: a request's key is hashed and looked up in one GET. Keys (all under the prefix):

    tenants                      set of tenant names
    tenant:{name}                hash {name, created_at, and sched_tier or sched_weight
                                 when set (gateway.tenancy.weights), self_service_keys
                                 "1" when the admin lets the tenant manage its keys}
    tenant:{name}:keys           set of key ids
    tenant:{name}:adapters       hash adapter name -> JSON TenantAdapter
    apikey:{sha256 hex}          string: "{key_id} {tenant}"
    keyid:{key_id}               hash {tenant, hash, created_at}

sha256 (not a slow password hash) is right here: the key has 256 bits of entropy, so there is
nothing to brute-force, and the lookup must be fast on every request.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import redis.asyncio as aioredis
import redis.exceptions

from gateway.errors import AuthenticationError, ConflictError, InvalidRequestError, NotFoundError

log = logging.getLogger(__name__)

KEY_PREFIX = "sk-"
KEY_BYTES = 32
TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    created_at: int


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: the tenant and which of its keys (for usage and revocation)."""

    tenant: str
    key_id: str


@dataclass(frozen=True, slots=True)
class NewKey:
    """A freshly created key: `key` exists only in this object and the response showing it."""

    key_id: str
    key: str
    tenant: str
    created_at: int


@dataclass(frozen=True, slots=True)
class TenantAdapter:
    """A tenant's name for a stored adapter (workers fetch it from the store by id)."""

    name: str
    adapter_id: str
    created_at: int
    rank: int = 0  # the largest rank of any module
    target_modules: list[str] = field(default_factory=list)
    num_bytes: int = 0  # float32 bytes of all A and B (what a worker's host cache holds)
    # When the name last got new content (a replacing upload); created_at until then.
    updated_at: int = 0
    # 1 for the name's first content, +1 for each replacing upload (0: written before versions
    # were counted, shown as 1).
    version: int = 0
    # The base it was validated against and runs on ("": written before bases were named,
    # the gateway's default base).
    base: str = ""

    @property
    def current_version(self) -> int:
        return max(1, self.version)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> TenantAdapter:
        """Fields this version knows; records written by older versions still load."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_tenant_name(name: str) -> str:
    if not TENANT_NAME.match(name):
        raise InvalidRequestError(
            "tenant name must be 1-63 characters of a-z, 0-9, '-' or '_', starting with a "
            "letter or digit",
            param="name",
        )
    return name


# Bound on the in-process key cache (entries are ~200 bytes).
MAX_CACHED_KEYS = 100_000


class TenantStore:
    """All tenant state; every method is one or a few Redis round trips."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str,
        key_cache_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = client
        self.prefix = prefix
        self.clock = clock  # the key cache's time (monotonic seconds)
        # Known keys, by hash: (caller, monotonic expiry). Authentication is a Redis round
        # trip on every request, ~10% of a gateway's CPU under load; a key revoked through
        # another gateway replica keeps working here for at most key_cache_s.
        self.key_cache_s = key_cache_s
        self._known_keys: dict[str, tuple[Caller, float]] = {}
        # Past half its life a known key is checked again off the request's path, so a key
        # in steady use never waits for Redis (the wait came once per key per key_cache_s:
        # a round trip, milliseconds on a loaded machine); an entry never outlives its
        # expiry either way.
        self._rechecks: dict[str, asyncio.Task] = {}

    def cached_until(self, key: str) -> float | None:
        """When this replica's cached entry for `key` expires (on `clock`); None if uncached."""
        known = self._known_keys.get(hash_key(key))
        return known[1] if known is not None else None

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    async def create_tenant(self, name: str) -> Tenant:
        check_tenant_name(name)
        if not await self.redis.sadd(self._k("tenants"), name):
            raise ConflictError(f"tenant {name!r} already exists", param="name")
        tenant = Tenant(name=name, created_at=int(time.time()))
        await self.redis.hset(self._k("tenant", name), mapping=asdict(tenant))
        return tenant

    async def list_tenants(self) -> list[Tenant]:
        names = sorted(await self.redis.smembers(self._k("tenants")))
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(self._k("tenant", name))
            rows = await pipe.execute()
        return [Tenant(name=r["name"], created_at=int(r["created_at"])) for r in rows if r]

    async def require_tenant(self, name: str) -> None:
        if not await self.redis.sismember(self._k("tenants"), name):
            raise NotFoundError(f"tenant {name!r} does not exist", param="tenant")

    async def create_key(self, tenant: str) -> NewKey:
        await self.require_tenant(tenant)
        key = KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)
        new = NewKey(
            key_id="key_" + secrets.token_hex(12),
            key=key,
            tenant=tenant,
            created_at=int(time.time()),
        )
        digest = hash_key(key)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("apikey", digest), f"{new.key_id} {tenant}")
            pipe.hset(
                self._k("keyid", new.key_id),
                mapping={"tenant": tenant, "hash": digest, "created_at": new.created_at},
            )
            pipe.sadd(self._k("tenant", tenant, "keys"), new.key_id)
            await pipe.execute()
        return new

    async def list_keys(self, tenant: str) -> list[dict[str, str | int]]:
        """The tenant's keys: ids and creation times (Redis has no secret to show)."""
        await self.require_tenant(tenant)
        ids = sorted(await self.redis.smembers(self._k("tenant", tenant, "keys")))
        async with self.redis.pipeline(transaction=False) as pipe:
            for key_id in ids:
                pipe.hget(self._k("keyid", key_id), "created_at")
            created = await pipe.execute()
        return [
            {"key_id": key_id, "created_at": int(at)}
            for key_id, at in zip(ids, created, strict=True)
            if at is not None
        ]

    async def set_self_service_keys(self, tenant: str, allowed: bool) -> None:
        """Whether the tenant may create and revoke its own keys (`/v1/account/keys`)."""
        await self.require_tenant(tenant)
        await self.redis.hset(self._k("tenant", tenant), "self_service_keys", int(allowed))

    async def self_service_keys(self, tenant: str) -> bool:
        return await self.redis.hget(self._k("tenant", tenant), "self_service_keys") == "1"

    async def revoke_key(self, key_id: str, *, tenant: str | None = None) -> None:
        """Revoke a key; with `tenant`, only one of that tenant's (another's is "missing")."""
        record = await self.redis.hgetall(self._k("keyid", key_id))
        if not record or (tenant is not None and record["tenant"] != tenant):
            raise NotFoundError(f"key {key_id!r} does not exist", param="key_id")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._k("apikey", record["hash"]))
            pipe.delete(self._k("keyid", key_id))
            pipe.srem(self._k("tenant", record["tenant"], "keys"), key_id)
            await pipe.execute()
        self._known_keys.pop(record["hash"], None)

    async def authenticate(self, key: str | None) -> Caller:
        """The tenant owning `key`; AuthenticationError for a missing, unknown or revoked key."""
        if not key:
            raise AuthenticationError(
                "You didn't provide an API key: send `Authorization: Bearer sk-...`."
            )
        digest = hash_key(key)
        known = self._known_keys.get(digest)
        now = self.clock()
        if known is not None and known[1] > now:
            if known[1] - now < self.key_cache_s / 2 and digest not in self._rechecks:
                recheck = asyncio.create_task(self._recheck(digest, known))
                self._rechecks[digest] = recheck
                recheck.add_done_callback(lambda _: self._rechecks.pop(digest, None))
            return known[0]
        found = await self.redis.get(self._k("apikey", digest))
        if found is None:
            self._known_keys.pop(digest, None)
            raise AuthenticationError("Incorrect API key provided.")
        key_id, tenant = found.split(" ", 1)
        caller = Caller(tenant=tenant, key_id=key_id)
        if self.key_cache_s > 0:
            if len(self._known_keys) >= MAX_CACHED_KEYS:
                self._known_keys.clear()  # bounded; refills from Redis at one trip per key
            self._known_keys[digest] = (caller, now + self.key_cache_s)
        return caller

    async def _recheck(self, digest: str, known: tuple[Caller, float]) -> None:
        """Renew a known key's entry, or drop it if the key is gone (revoked elsewhere)."""
        try:
            found = await self.redis.get(self._k("apikey", digest))
        except redis.exceptions.RedisError as exc:
            log.warning("re-checking an API key failed (its entry expires as usual): %r", exc)
            return
        if self._known_keys.get(digest) is not known:
            return  # revoked here, or replaced, meanwhile: leave it as it is now
        if found is None:
            del self._known_keys[digest]
        else:
            self._known_keys[digest] = (known[0], self.clock() + self.key_cache_s)

    def adapters_key(self, tenant: str) -> str:
        """The tenant's names hash (adapter name -> JSON TenantAdapter), for the catalog's
        registration script."""
        return self._k("tenant", tenant, "adapters")

    async def add_adapter(self, tenant: str, adapter: TenantAdapter) -> bool:
        """Record the name unless the tenant already uses it; False if it does."""
        key = self._k("tenant", tenant, "adapters")
        return bool(await self.redis.hsetnx(key, adapter.name, adapter.to_json()))

    async def get_adapter(self, tenant: str, name: str) -> TenantAdapter | None:
        raw = await self.redis.hget(self._k("tenant", tenant, "adapters"), name)
        return TenantAdapter.from_json(raw) if raw is not None else None

    async def list_adapters(self, tenant: str) -> list[TenantAdapter]:
        raw = await self.redis.hgetall(self._k("tenant", tenant, "adapters"))
        return [TenantAdapter.from_json(raw[name]) for name in sorted(raw)]
