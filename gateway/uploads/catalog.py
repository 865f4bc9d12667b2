"""Tenants' adapter names over content-addressed blobs: registration and deletion that
never leave a name without its blob, nor, past a grace period, a blob nobody names.

Two tenants who upload the same adapter share one blob (ids are content hashes), so a blob
is reference-counted by the names pointing at it, in Redis:

    tenant:{name}:adapters       hash name -> JSON TenantAdapter (gateway.tenancy.tenants)
    adapter:{id}:refs            set of "tenant/name"
    {tenant}:uploads             sorted set: upload id -> lease expiry (ms)

Naming is one Lua script (`upload_scripts.REGISTER`): the name is reserved, the storage
quota checked and the reference added together, so of two uploads of one name exactly one
wins and the other changes nothing. The blob is put in the store *before* it is named, and
a blob leaves the store only by this protocol: move it aside, look at its references again,
and put it back if a name appeared. An upload whose blob vanished meanwhile puts it back
from its own staged copy. So a named blob is never deleted, and whatever a crash leaves
(staging directories, an unnamed blob) is swept once older than the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from adapters import ArchiveLimits, BaseModelSpec
from adapters.stores import AdapterStore
from gateway.errors import ConflictError, GatewayError, NotFoundError, RateLimitError
from gateway.settings import GatewaySettings
from gateway.tenancy.quotas import tenant_key
from gateway.tenancy.tenants import TenantAdapter, TenantStore
from gateway.uploads.catalog_scripts import ACQUIRE_UPLOAD, REGISTER, RENEW_UPLOAD, UNREGISTER
from gateway.uploads.validation import UploadValidator, ValidatedUpload, ValidationLimits

log = logging.getLogger(__name__)


class AdapterQuotaError(GatewayError):
    """The tenant's adapter count or storage quota is full: deleting adapters frees it, so
    a retry alone never helps (403, not 429)."""

    status = 403
    type = "insufficient_quota"
    code = "adapter_quota_exceeded"


@dataclass(frozen=True, slots=True)
class Removal:
    record: TenantAdapter
    last_reference: bool  # the blob was deleted: workers should unload it


@dataclass(frozen=True, slots=True)
class Registration:
    record: TenantAdapter
    created: bool  # False: the same content was already under this name (idempotent)
    replaced: Removal | None = None  # the content this upload replaced under the name


@dataclass(frozen=True, slots=True)
class StorageDefaults:
    """Settings' defaults for tenants whose quota leaves the field out."""

    max_adapters: int
    max_adapter_bytes: int
    max_concurrent_uploads: int
    upload_lease_s: float
    sweep_grace_s: float = 3600.0
    sweep_interval_s: float = 0.0  # 0: only the sweep at start


class AdapterCatalog:
    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        prefix: str,
        tenants: TenantStore,
        store: AdapterStore,
        defaults: StorageDefaults,
        validator: UploadValidator,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.tenants = tenants
        self.store = store
        self.defaults = defaults
        self.validator = validator
        self._register = redis.register_script(REGISTER)
        self._unregister = redis.register_script(UNREGISTER)
        self._acquire = redis.register_script(ACQUIRE_UPLOAD)
        self._renew = redis.register_script(RENEW_UPLOAD)

    @classmethod
    def from_settings(
        cls,
        settings: GatewaySettings,
        *,
        redis: aioredis.Redis,
        tenants: TenantStore,
        store: AdapterStore,
        config: Mapping[str, Any],
    ) -> AdapterCatalog:
        """The catalog and its validation children, as the settings say."""
        validator = UploadValidator(
            base=BaseModelSpec.from_config_dict(config),
            max_lora_rank=settings.max_lora_rank,
            max_bytes=settings.max_adapter_bytes,
            archive_limits=ArchiveLimits(
                max_members=settings.max_archive_members,
                max_member_bytes=settings.max_adapter_bytes,
                max_total_bytes=settings.max_adapter_bytes + (1 << 20),
            ),
            limits=ValidationLimits(
                cpu_s=settings.upload_validation_cpu_s,
                memory_bytes=settings.upload_validation_memory_bytes,
                wall_s=2.0 * settings.upload_validation_cpu_s,
                concurrency=settings.upload_validations,
            ),
        )
        defaults = StorageDefaults(
            max_adapters=settings.default_max_adapters,
            max_adapter_bytes=settings.default_max_adapter_storage_bytes,
            max_concurrent_uploads=settings.max_concurrent_uploads,
            upload_lease_s=settings.quota_lease_s,
            sweep_grace_s=settings.adapter_sweep_grace_s,
            sweep_interval_s=settings.adapter_sweep_interval_s,
        )
        return cls(
            redis=redis,
            prefix=settings.key_prefix,
            tenants=tenants,
            store=store,
            defaults=defaults,
            validator=validator,
        )

    def _refs(self, adapter_id: str) -> str:
        return f"{self.prefix}adapter:{adapter_id}:refs"

    async def names_of(self, adapter_ids: list[str]) -> dict[str, list[str]]:
        """Each content id's names, as "tenant/name" (for the admin's view of the fleet)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for adapter_id in adapter_ids:
                pipe.smembers(self._refs(adapter_id))
            refs = await pipe.execute()
        return {a: sorted(r) for a, r in zip(adapter_ids, refs, strict=True)}

    def _names(self, tenant: str) -> str:
        return self.tenants.adapters_key(tenant)

    @contextlib.asynccontextmanager
    async def upload_slot(self, tenant: str) -> AsyncIterator[None]:
        """One of the tenant's concurrent-upload slots for the block, or RateLimitError."""
        upload_id = uuid.uuid4().hex
        key = tenant_key(self.prefix, tenant, "uploads")
        lease_ms = max(1, int(self.defaults.upload_lease_s * 1000))
        cap = self.defaults.max_concurrent_uploads
        taken, running = await self._acquire(keys=[key], args=[upload_id, lease_ms, cap])
        if not taken:
            retry_s = max(1, round(self.defaults.upload_lease_s / 3))
            raise RateLimitError(
                f"Too many concurrent adapter uploads for tenant {tenant}: Limit {cap}, "
                f"Running {running}. Please try again once one has finished.",
                kind="requests",
                headers={"retry-after": str(retry_s)},
            )
        renewal = asyncio.create_task(self._keep_leased(key, upload_id, lease_ms))
        try:
            yield
        finally:
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal
            try:
                await self.redis.zrem(key, upload_id)
            except redis.exceptions.RedisError as exc:  # the lease expires by itself
                log.warning("releasing upload slot %s failed: %r", upload_id, exc)

    async def _keep_leased(self, key: str, upload_id: str, lease_ms: int) -> None:
        while True:
            await asyncio.sleep(lease_ms / 3000)
            try:
                if not await self._renew(keys=[key], args=[upload_id, lease_ms]):
                    return
            except redis.exceptions.RedisError as exc:
                log.warning("renewing upload slot %s failed: %r", upload_id, exc)

    async def register(
        self, tenant: str, name: str, upload: ValidatedUpload, *, replace: bool = False
    ) -> Registration:
        """Put the validated blob in the store and name it for `tenant`, atomically with
        the quota check; ConflictError if the name holds other content, unless `replace`:
        then the name moves to the new content in one step (a new version) and the old
        content's blob goes once no name references it."""
        adopted = await asyncio.to_thread(self.store.adopt, upload.adapter_id, upload.blob)
        try:
            outcome, rest, previous = await self._name(tenant, name, upload, replace=replace)
        except BaseException:
            if adopted:
                await self._delete_blob_if_unreferenced(upload.adapter_id)
            raise
        if outcome in ("created", "same", "replaced"):
            # A concurrent deletion of the same content's last other name may have taken
            # the blob between `adopt` and the script: put it back from our staged copy.
            if not await asyncio.to_thread(self.store.exists, upload.adapter_id):
                await asyncio.to_thread(self.store.adopt, upload.adapter_id, upload.blob)
            replaced = None
            if outcome == "replaced":
                assert previous is not None
                last = int(rest[1]) == 0 and await self._delete_blob_if_unreferenced(
                    previous.adapter_id
                )
                replaced = Removal(record=previous, last_reference=last)
            record = TenantAdapter.from_json(rest[0])
            return Registration(record, created=outcome == "created", replaced=replaced)
        if adopted:  # we brought this blob and nobody named it: it goes (by the protocol)
            await self._delete_blob_if_unreferenced(upload.adapter_id)
        if outcome == "taken":
            raise _name_taken(name)
        used, limit = (int(v) for v in rest)
        if outcome == "max_adapters":
            raise AdapterQuotaError(
                f"tenant {tenant} has {used} adapters, its limit of {limit}; delete one "
                "before uploading another",
                param="name",
            )
        raise AdapterQuotaError(
            f"adapter storage quota exceeded for tenant {tenant}: Limit {limit} bytes, Used "
            f"{used}, Requested {upload.num_bytes} (float32 bytes of the adapters' weights)",
            param="file",
        )

    async def _name(
        self, tenant: str, name: str, upload: ValidatedUpload, *, replace: bool
    ) -> tuple[str, list, TenantAdapter | None]:
        """The REGISTER script's outcome, its values, and the record it replaced (if any).
        A replacing upload reads the name's record first (its blob's references are a key of
        the script) and tries again if the name moved in between."""
        now = int(time.time())
        for _ in range(8):
            previous = await self.tenants.get_adapter(tenant, name) if replace else None
            record = TenantAdapter(
                name=name,
                adapter_id=upload.adapter_id,
                created_at=now if previous is None else previous.created_at,
                rank=upload.rank,
                target_modules=upload.target_modules,
                num_bytes=upload.num_bytes,
                updated_at=now,
                version=1 if previous is None else previous.current_version + 1,
                base=upload.base,
            )
            old_id = "" if previous is None else previous.adapter_id
            outcome, *rest = await self._register(
                keys=[
                    self._names(tenant),
                    self._refs(upload.adapter_id),
                    tenant_key(self.prefix, tenant, "quota"),
                    self._refs(old_id or upload.adapter_id),
                ],
                args=[
                    name,
                    record.to_json(),
                    f"{tenant}/{name}",
                    upload.adapter_id,
                    upload.num_bytes,
                    self.defaults.max_adapters,
                    self.defaults.max_adapter_bytes,
                    "1" if replace else "0",
                    old_id,
                    0 if previous is None else previous.version,
                ],
            )
            if outcome != "moved":
                return outcome, rest, previous
        raise ConflictError(
            f"the adapter {name!r} kept changing while this upload replaced it; try again",
            param="name",
        )

    async def remove(self, tenant: str, name: str) -> Removal:
        """Forget `tenant`'s name; delete the blob if no other name points at it."""
        record = await self.tenants.get_adapter(tenant, name)
        if record is None:
            raise adapter_not_found(name)
        left = await self._unregister(
            keys=[self._names(tenant), self._refs(record.adapter_id)],
            args=[name, record.adapter_id, f"{tenant}/{name}"],
        )
        if left < 0:
            raise adapter_not_found(name)  # deleted or replaced concurrently
        last = left == 0 and await self._delete_blob_if_unreferenced(record.adapter_id)
        return Removal(record=record, last_reference=last)

    async def _delete_blob_if_unreferenced(self, adapter_id: str) -> bool:
        """Delete the blob unless a name references it, by moving it aside first and
        looking again: a name added meanwhile gets its blob back."""
        if await self.redis.scard(self._refs(adapter_id)):
            return False
        aside = await asyncio.to_thread(self.store.set_aside, adapter_id)
        if aside is None:
            return False
        if await self.redis.scard(self._refs(adapter_id)):
            await asyncio.to_thread(self.store.restore, adapter_id, aside)
            return False
        await asyncio.to_thread(self.store.discard, aside)
        return True

    async def sweep(self, *, grace_s: float) -> tuple[list[str], list[str]]:
        """Remove the store's crash leftovers older than `grace_s`: staging and trash
        directories, and blobs no name references. Returns (leftovers, blob ids) removed."""
        leftovers, blobs = await asyncio.to_thread(self.store.stale_entries, grace_s=grace_s)
        for entry in leftovers:
            await asyncio.to_thread(self.store.discard_leftover, entry)
        deleted = [b for b in blobs if await self._delete_blob_if_unreferenced(b)]
        if leftovers or deleted:
            log.info(
                "adapter store swept: %d leftovers, %d unnamed blobs", len(leftovers), len(deleted)
            )
        return [Path(str(p)).name for p in leftovers], deleted

    async def keep_swept(self) -> None:
        """Sweep at start, then every `sweep_interval_s` (a background task). A failed
        sweep is logged and tried again next time."""
        while True:
            try:
                await self.sweep(grace_s=self.defaults.sweep_grace_s)
            except (OSError, redis.exceptions.RedisError) as exc:
                log.warning("sweeping the adapter store failed: %r", exc)
            if self.defaults.sweep_interval_s <= 0:
                return
            await asyncio.sleep(self.defaults.sweep_interval_s)


def adapter_not_found(name: str) -> NotFoundError:
    """The same answer for a missing adapter and another tenant's: existence never leaks."""
    return NotFoundError(f"The adapter `{name}` does not exist.", param="name")


def _name_taken(name: str) -> ConflictError:
    return ConflictError(
        f"an adapter named {name!r} already exists with other content; upload with "
        "replace=true to make this its new version, delete it first, or pick another name",
        param="name",
    )
