"""`/v1/files` for batch work: a tenant's uploaded inputs and the outputs made for them.

A file is a record in Redis (`{prefix}{tenant}:bfile:<id>`, listed newest first in
`…:bfiles`) and its bytes in the store's backend (`gateway.batch.storage.FileBlobs`), keyed
by the file id. One Lua script registers a file and counts its bytes against the tenant's
storage quota in one step, so concurrent uploads never overshoot it; deleting gives the bytes
back. Every file expires (`expires_at`: the upload's own `expires_after`, at most the
gateway's retention); an expired file is gone for its tenant at once, and its bytes are swept.
A file a batch still reads (its input while the batch runs) cannot be deleted (409).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO

import redis.asyncio as aioredis

from gateway.batch.storage import FileBlobs
from gateway.errors import ConflictError, InvalidRequestError, NotFoundError, PermissionDeniedError
from gateway.tenancy.quotas import tenant_key

INPUT_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"
EXPIRY_SET = "bfiles:expiry"  # every file's expiry, across tenants: member "tenant\0id"

# KEYS: 1 file record, 2 tenant's index, 3 tenant's bytes, 4 expiry set;
# ARGV: 1 id, 2 bytes, 3 quota, 4 created_at, 5 expires_at, 6 expiry member, 7.. field pairs.
# Registers the file and counts its bytes unless that would pass the quota (returns -1).
REGISTER = """
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
local size = tonumber(ARGV[2])
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if used + size > tonumber(ARGV[3]) then return -1 end
redis.call('INCRBY', KEYS[3], size)
local fields = {}
for i = 7, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[6])
return 1
"""

# KEYS: 1 file record, 2 tenant's index, 3 tenant's bytes, 4 expiry set; ARGV: 1 id,
# 2 expiry member, 3 force (1: even while a batch reads it). Returns the bytes given back,
# -1 when absent, -2 when a batch reads it.
FORGET = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if ARGV[3] ~= '1' and redis.call('HGET', KEYS[1], 'in_use_by') then return -2 end
local size = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0')
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[2])
redis.call('DECRBY', KEYS[3], size)
return size
"""


@dataclass(frozen=True, slots=True)
class FileRecord:
    """A file as OpenAI's `FileObject` shows it (`status` is deprecated there: always
    `processed` here, as a file is whole once listed)."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int

    def to_openai(self) -> dict[str, Any]:
        return {**asdict(self), "object": "file", "status": "processed", "status_details": None}

    @classmethod
    def from_hash(cls, fields: dict[str, str]) -> FileRecord:
        return cls(
            id=fields["id"],
            bytes=int(fields["bytes"]),
            created_at=int(fields["created_at"]),
            filename=fields["filename"],
            purpose=fields["purpose"],
            expires_at=int(fields["expires_at"]),
        )


@dataclass(frozen=True, slots=True)
class FileLimits:
    quota_bytes: int  # per tenant, inputs and outputs together
    retention_s: int  # the longest a file is kept


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


class FileService:
    def __init__(
        self, redis: aioredis.Redis, *, prefix: str, blobs: FileBlobs, limits: FileLimits
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.blobs = blobs
        self.limits = limits
        self._register = redis.register_script(REGISTER)
        self._forget = redis.register_script(FORGET)

    def _k(self, tenant: str, name: str) -> str:
        return tenant_key(self.prefix, tenant, name)

    def _keys(self, tenant: str, file_id: str) -> list[str]:
        return [
            self._k(tenant, f"bfile:{file_id}"),
            self._k(tenant, "bfiles"),
            self._k(tenant, "bfile_bytes"),
            self.prefix + EXPIRY_SET,
        ]

    def expires_at(self, created_at: int, requested_s: int | None) -> int:
        keep = self.limits.retention_s
        return created_at + (keep if requested_s is None else min(requested_s, keep))

    async def create(
        self,
        tenant: str,
        *,
        source: BinaryIO,
        filename: str,
        purpose: str,
        expires_after_s: int | None = None,
        file_id: str | None = None,
    ) -> FileRecord:
        """Store ``source`` and register it (403 past the tenant's storage quota). With a
        ``file_id`` given (a batch's output, named after the batch) a second call is a no-op
        that returns the first record: finalizing twice makes one file."""
        if file_id is not None and (existing := await self.get(tenant, file_id, missing_ok=True)):
            return existing
        file_id = file_id or new_file_id()
        size = await asyncio.to_thread(self.blobs.put, file_id, source)
        now = int(time.time())
        record = FileRecord(
            id=file_id,
            bytes=size,
            created_at=now,
            filename=filename,
            purpose=purpose,
            expires_at=self.expires_at(now, expires_after_s),
        )
        fields = [x for k, v in asdict(record).items() for x in (k, str(v))]
        args = [file_id, size, self.limits.quota_bytes, now, record.expires_at]
        outcome = await self._register(
            keys=self._keys(tenant, file_id), args=[*args, f"{tenant}\0{file_id}", *fields]
        )
        if outcome == -1:
            await asyncio.to_thread(self.blobs.delete, file_id)
            raise PermissionDeniedError(
                f"storing this file ({size} bytes) would pass your file storage quota of "
                f"{self.limits.quota_bytes} bytes; delete files you no longer need",
            )
        if outcome == 0:  # registered meanwhile (a concurrent finalize): theirs stands
            return await self.get(tenant, file_id)
        return record

    async def get(self, tenant: str, file_id: str, *, missing_ok: bool = False) -> Any:
        """The tenant's file (another tenant's answers exactly as a missing one: 404)."""
        fields = await self.redis.hgetall(self._k(tenant, f"bfile:{file_id}"))
        if not fields or int(fields["expires_at"]) <= time.time():
            if missing_ok:
                return None
            raise file_not_found(file_id)
        return FileRecord.from_hash(fields)

    async def list(
        self,
        tenant: str,
        *,
        purpose: str | None = None,
        limit: int = 10000,
        after: str | None = None,
        order: str = "desc",
    ) -> tuple[list[FileRecord], bool]:
        """The tenant's live files, newest first (or oldest with ``order='asc'``), from just
        past ``after``; and whether more follow."""
        index = self._k(tenant, "bfiles")
        ids = await (
            self.redis.zrange(index, 0, -1)
            if order == "asc"
            else self.redis.zrevrange(index, 0, -1)
        )
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        records: list[FileRecord] = []
        for file_id in ids:
            record = await self.get(tenant, file_id, missing_ok=True)
            if record is None or (purpose is not None and record.purpose != purpose):
                continue
            if len(records) == limit:
                return records, True
            records.append(record)
        return records, False

    async def delete(self, tenant: str, file_id: str, *, force: bool = False) -> None:
        outcome = await self._forget(
            keys=self._keys(tenant, file_id), args=[file_id, f"{tenant}\0{file_id}", int(force)]
        )
        if outcome == -1:
            raise file_not_found(file_id)
        if outcome == -2:
            raise ConflictError(
                f"file {file_id} is the input of a batch in progress; cancel the batch first",
                param="file_id",
            )
        await asyncio.to_thread(self.blobs.delete, file_id)

    async def mark_in_use(self, tenant: str, file_id: str, batch_id: str | None) -> None:
        key = self._k(tenant, f"bfile:{file_id}")
        if batch_id is None:
            await self.redis.hdel(key, "in_use_by")
        elif await self.redis.exists(key):
            await self.redis.hset(key, "in_use_by", batch_id)

    async def read(self, tenant: str, file_id: str) -> bytes:
        await self.get(tenant, file_id)
        return await asyncio.to_thread(self.blobs.read, file_id)

    async def sweep_expired(self, *, now: float | None = None, limit: int = 100) -> int:
        """Delete files past their expiry (every tenant's), oldest first; returns how many."""
        now = time.time() if now is None else now
        due = await self.redis.zrangebyscore(
            self.prefix + EXPIRY_SET, "-inf", now, start=0, num=limit
        )
        for member in due:
            tenant, _, file_id = member.partition("\0")
            try:
                await self.delete(tenant, file_id, force=True)
            except NotFoundError:
                await self.redis.zrem(self.prefix + EXPIRY_SET, member)
        return len(due)


def file_not_found(file_id: str) -> NotFoundError:
    return NotFoundError(f"No such File object: {file_id}", param="file_id")


def check_purpose(purpose: str) -> None:
    if purpose != INPUT_PURPOSE:
        raise InvalidRequestError(
            f"purpose {purpose[:40]!r} is not served here: upload batch inputs with "
            f"purpose {INPUT_PURPOSE!r}",
            param="purpose",
        )
