"""`/v1/batches`: a tenant's batches as records in Redis, in OpenAI's `Batch` shape.

A batch is a hash `{prefix}{tenant}:batch:<id>` (its status moved only by
`gateway.batch.states`), listed newest first in `…:batches`; its lines' results are a hash
`…:batch:<id>:lines` (line index → the output or error line, written once, with its billing:
`gateway.batch.lines`). Batches not yet final are members `tenant\\0id` of one active set,
which the runners (`gateway.batch.runner`) read to find work.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from gateway.batch.files import INPUT_PURPOSE, FileService
from gateway.batch.states import BatchStatus, StateMachine, TransitionRefused
from gateway.errors import ConflictError, InvalidRequestError, NotFoundError
from gateway.tenancy.quotas import tenant_key

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
ACTIVE_SET = "batches:active"
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
COUNTS = ("total", "completed", "failed")
USAGE = ("input_tokens", "output_tokens", "cached_tokens")


@dataclass(frozen=True, slots=True)
class BatchRef:
    """Which batch: its tenant and id (the active set's member is `tenant\\0id`)."""

    tenant: str
    batch_id: str

    @property
    def member(self) -> str:
        return f"{self.tenant}\0{self.batch_id}"

    @classmethod
    def of_member(cls, member: str) -> BatchRef:
        tenant, _, batch_id = member.partition("\0")
        return cls(tenant, batch_id)


@dataclass(frozen=True, slots=True)
class Batch:
    """A stored batch, read whole."""

    id: str
    status: BatchStatus
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    stamps: dict[str, int] = field(default_factory=dict)  # "<status>_at" → when
    counts: dict[str, int] = field(default_factory=dict)
    usage: dict[str, int] = field(default_factory=dict)
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    output_expires_after_s: int | None = None  # the output files' `expires_after`

    @classmethod
    def from_hash(cls, h: dict[str, str]) -> Batch:
        return cls(
            id=h["id"],
            status=BatchStatus(h["status"]),
            endpoint=h["endpoint"],
            input_file_id=h["input_file_id"],
            completion_window=h["completion_window"],
            created_at=int(h["created_at"]),
            expires_at=int(h["expires_at"]),
            stamps={s.stamp: int(h[s.stamp]) for s in BatchStatus if s.stamp in h},
            counts={c: int(h.get(c, 0)) for c in COUNTS},
            usage={u: int(h.get(u, 0)) for u in USAGE},
            output_file_id=h.get("output_file_id") or None,
            error_file_id=h.get("error_file_id") or None,
            errors=json.loads(h["errors"]) if h.get("errors") else None,
            metadata=json.loads(h["metadata"]) if h.get("metadata") else None,
            output_expires_after_s=int(h["output_expires_after_s"])
            if h.get("output_expires_after_s")
            else None,
        )

    def to_openai(self) -> dict[str, Any]:
        stamps = {s.stamp: self.stamps.get(s.stamp) for s in BatchStatus if s is not S_VALIDATING}
        inputs, outputs = self.usage["input_tokens"], self.usage["output_tokens"]
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": None if self.errors is None else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status.value,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            **stamps,
            "request_counts": dict(self.counts),
            "usage": {
                "input_tokens": inputs,
                "input_tokens_details": {"cached_tokens": self.usage["cached_tokens"]},
                "output_tokens": outputs,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": inputs + outputs,
            },
            "metadata": self.metadata,
        }


S_VALIDATING = BatchStatus.VALIDATING


def check_metadata(metadata: dict[str, Any] | None) -> dict[str, str] | None:
    """OpenAI's metadata bounds: 16 pairs, keys ≤ 64 characters, string values ≤ 512."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS:
        raise InvalidRequestError(
            f"metadata holds at most {MAX_METADATA_KEYS} key-value pairs", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(value, str):
            raise InvalidRequestError(
                f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters and values "
                "are strings",
                param="metadata",
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidRequestError(
                f"metadata values are at most {MAX_METADATA_VALUE_CHARS} characters",
                param="metadata",
            )
    return dict(metadata)


def batch_not_found(batch_id: str) -> NotFoundError:
    return NotFoundError(f"No batch found with id '{batch_id}'.", param="batch_id")


class BatchService:
    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        prefix: str,
        files: FileService,
        windows: dict[str, int],
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.files = files
        self.windows = windows
        self.machine = StateMachine(redis, active_key=prefix + ACTIVE_SET)
        # Set when this replica creates a batch: its runner looks at once instead of at its
        # next poll (other replicas' runners find it at theirs).
        self.created = asyncio.Event()

    def key(self, ref: BatchRef, part: str = "") -> str:
        return tenant_key(self.prefix, ref.tenant, f"batch:{ref.batch_id}{part}")

    def lines_key(self, ref: BatchRef) -> str:
        return self.key(ref, ":lines")

    async def create(
        self,
        tenant: str,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, Any] | None = None,
        output_expires_after_s: int | None = None,
    ) -> Batch:
        if endpoint not in ENDPOINTS:
            raise InvalidRequestError(
                f"endpoint {endpoint[:60]!r} is not served in batches here; one of "
                + ", ".join(ENDPOINTS),
                param="endpoint",
            )
        window_s = self.windows.get(completion_window)
        if window_s is None:
            raise InvalidRequestError(
                f"completion_window must be one of {sorted(self.windows)}",
                param="completion_window",
            )
        meta = check_metadata(metadata)
        record = await self.files.get(tenant, input_file_id)
        if record.purpose != INPUT_PURPOSE:
            raise InvalidRequestError(
                f"file {input_file_id} has purpose {record.purpose!r}, not {INPUT_PURPOSE!r}",
                param="input_file_id",
            )
        now = int(time.time())
        ref = BatchRef(tenant, "batch_" + secrets.token_hex(12))
        fields: dict[str, str | int] = {
            "id": ref.batch_id,
            "status": BatchStatus.VALIDATING.value,
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "created_at": now,
            "expires_at": now + window_s,
            **dict.fromkeys(COUNTS, 0),
        }
        if meta is not None:
            fields["metadata"] = json.dumps(meta)
        if output_expires_after_s is not None:
            fields["output_expires_after_s"] = output_expires_after_s
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.key(ref), mapping=fields)
            pipe.zadd(tenant_key(self.prefix, tenant, "batches"), {ref.batch_id: now})
            pipe.sadd(self.prefix + ACTIVE_SET, ref.member)
            await pipe.execute()
        await self.files.mark_in_use(tenant, input_file_id, ref.batch_id)
        self.created.set()
        return await self.get(ref)

    async def get(self, ref: BatchRef) -> Batch:
        fields = await self.redis.hgetall(self.key(ref))
        if not fields:
            raise batch_not_found(ref.batch_id)
        return Batch.from_hash(fields)

    async def status(self, ref: BatchRef) -> BatchStatus:
        """The stored status alone (a runner's periodic check reads no more than that)."""
        value = await self.redis.hget(self.key(ref), "status")
        if value is None:
            raise batch_not_found(ref.batch_id)
        return BatchStatus(value)

    async def list(
        self, tenant: str, *, after: str | None = None, limit: int = 20
    ) -> tuple[list[Batch], bool]:
        """Newest first, from just past ``after``; and whether more follow."""
        ids = await self.redis.zrevrange(tenant_key(self.prefix, tenant, "batches"), 0, -1)
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        batches = []
        for batch_id in ids[:limit]:
            try:
                batches.append(await self.get(BatchRef(tenant, batch_id)))
            except NotFoundError:
                continue
        return batches, len(ids) > limit

    async def cancel(self, ref: BatchRef) -> Batch:
        """`cancelling` (the runner then stops its lines, writes what finished and makes it
        `cancelled`); cancelling a batch already cancelling is a no-op; a final one is 409."""
        batch = await self.get(ref)
        if batch.status is BatchStatus.CANCELLING:
            return batch
        try:
            await self.machine.move(self.key(ref), ref.member, BatchStatus.CANCELLING)
        except TransitionRefused as refused:
            raise ConflictError(
                f"Cannot cancel a batch with status '{refused.current}'.", param="batch_id"
            ) from None
        return await self.get(ref)

    async def active(self) -> list[BatchRef]:
        return [BatchRef.of_member(m) for m in await self.redis.smembers(self.prefix + ACTIVE_SET)]

    async def move(
        self, ref: BatchRef, target: BatchStatus, fields: dict[str, str | int] | None = None
    ) -> BatchStatus:
        return await self.machine.move(self.key(ref), ref.member, target, fields=fields)
