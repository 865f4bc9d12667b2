"""Tenants' adapter names over content-addressed blobs: registration and deletion that
never leave a name without its blob, nor a blob nobody names.

Two tenants who upload the same adapter share one blob (ids are content hashes), so a blob
is reference-counted by the names pointing at it, in Redis:

    adapter:{id}:refs    set of "tenant/name"
    adapter:{id}:lock    redis-py lock held while a blob is written or deleted

Order makes crashes safe: a reference is added before the blob is written and the name
recorded, and removed only after the name is gone. A crash in between leaves an extra
reference (a blob kept too long), never a name whose blob was deleted. The lock keeps a
deletion of an adapter's last name from racing a new upload of the same content.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from adapters import FilesystemAdapterStore, LoraAdapter
from gateway.errors import ConflictError, NotFoundError
from gateway.tenants import TenantAdapter, TenantStore

# Longer than a store write of the largest adapter; a crashed holder's lock expires.
LOCK_TIMEOUT_S = 120.0
LOCK_WAIT_S = 60.0


@dataclass(frozen=True, slots=True)
class Removal:
    record: TenantAdapter
    last_reference: bool  # the blob was deleted: workers should unload it


class AdapterCatalog:
    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        prefix: str,
        tenants: TenantStore,
        store: FilesystemAdapterStore,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.tenants = tenants
        self.store = store

    def _refs(self, adapter_id: str) -> str:
        return f"{self.prefix}adapter:{adapter_id}:refs"

    def _lock(self, adapter_id: str):
        return self.redis.lock(
            f"{self.prefix}adapter:{adapter_id}:lock",
            timeout=LOCK_TIMEOUT_S,
            blocking_timeout=LOCK_WAIT_S,
        )

    async def check_name_free(self, tenant: str, name: str) -> None:
        """Cheap early refusal of a taken name, before an upload is validated."""
        if await self.tenants.get_adapter(tenant, name) is not None:
            raise _name_taken(name)

    async def register(self, tenant: str, name: str, adapter: LoraAdapter) -> TenantAdapter:
        """Store `adapter` and name it for `tenant`; ConflictError if the name is taken."""
        record = TenantAdapter(
            name=name,
            adapter_id=adapter.id,
            created_at=int(time.time()),
            rank=adapter.max_rank,
            target_modules=sorted(adapter.target_modules),
            num_bytes=adapter.num_bytes,
        )
        ref = f"{tenant}/{name}"
        async with self._lock(adapter.id):
            await self.redis.sadd(self._refs(adapter.id), ref)
            try:
                await asyncio.to_thread(self.store.put, adapter)
                if not await self.tenants.add_adapter(tenant, record):
                    raise _name_taken(name)
            except BaseException:
                await self._drop_reference(adapter.id, ref)
                raise
        return record

    async def remove(self, tenant: str, name: str) -> Removal:
        """Forget `tenant`'s name; delete the blob if no other name points at it."""
        record = await self.tenants.get_adapter(tenant, name)
        if record is None:
            raise adapter_not_found(name)
        async with self._lock(record.adapter_id):
            if not await self.tenants.remove_adapter_record(tenant, record):
                raise adapter_not_found(name)  # deleted or replaced concurrently
            last = await self._drop_reference(record.adapter_id, f"{tenant}/{name}")
        return Removal(record=record, last_reference=last)

    async def _drop_reference(self, adapter_id: str, ref: str) -> bool:
        """Remove one reference (lock held); delete the blob if it was the last."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.srem(self._refs(adapter_id), ref)
            pipe.scard(self._refs(adapter_id))
            _, remaining = await pipe.execute()
        if remaining:
            return False
        await asyncio.to_thread(self.store.delete, adapter_id)
        return True


def adapter_not_found(name: str) -> NotFoundError:
    """The same answer for a missing adapter and another tenant's: existence never leaks."""
    return NotFoundError(f"The adapter `{name}` does not exist.", param="name")


def _name_taken(name: str) -> ConflictError:
    return ConflictError(
        f"an adapter named {name!r} already exists; delete it first or pick another name",
        param="name",
    )
