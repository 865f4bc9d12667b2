"""The worker registry in Redis: which workers are alive, where, and how loaded they are.

Shared by the worker (which publishes itself) and the gateway (which routes over it), so it
imports neither torch nor anything from ``worker/``.

Format (the gateway codes against exactly this):
- ``{prefix}worker:{worker_id}`` holds a ``WorkerInfo`` as JSON, written with ``EX ttl``;
  a worker rewrites it every heartbeat, so a dead worker's key expires by itself.
- ``{prefix}workers`` is a set of worker ids (SADD on register, SREM on deregister).
  Ids whose key has expired are swept from it by ``live_workers``.

Records name the adapter ids each worker holds (the gateway routes by them), which is why
workers' own ``Stats`` answers only counts: the registry is for those holding Redis's
credentials (the password in the URL), i.e. gateways and workers.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field

from redis.asyncio import Redis

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "sb:"
# A worker is presumed dead this long after its last heartbeat.
DEFAULT_TTL_S = 10
# Five beats per TTL: a worker survives a few missed beats (a GC pause, a Redis blip).
HEARTBEAT_INTERVAL_S = 2.0


@dataclass(slots=True)
class WorkerInfo:
    """One worker as the gateway sees it; refreshed every heartbeat."""

    worker_id: str
    address: str  # "host:port" of its gRPC server
    model: str  # the base's name (clients' `model`); older workers wrote its path
    # The base's content id (runtime.bases.base_content_id; "" from workers before pools)
    # and the checkpoint directory it was read from, where a gateway under one of its
    # `model_roots` reads the base's tokenizer, chat template and config.
    base_id: str = ""
    model_path: str = ""
    adapters: list[str] = field(default_factory=list)  # content ids loaded on it
    # Where their weights are now: each device slot's content id (None: empty), and the host
    # cache's, most recently used first (content no longer named may linger in either).
    slot_adapters: list[str | None] = field(default_factory=list)
    # Content ids waiting for a device slot (queued requests need them, none is free).
    loading_adapters: list[str] = field(default_factory=list)
    host_adapters: list[str] = field(default_factory=list)
    host_cache_bytes: int = 0  # float32 bytes the host cache holds
    host_cache_limit: int = 0  # its byte budget
    running: int = 0
    waiting: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    heartbeat_at: float = 0.0  # unix time of the beat that wrote this

    @property
    def max_loras(self) -> int:
        """Device adapter slots (0: not reported)."""
        return len(self.slot_adapters)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, data: str | bytes) -> WorkerInfo:
        fields = json.loads(data)
        known = {name: fields[name] for name in cls.__dataclass_fields__ if name in fields}
        return cls(**known)


def worker_key(prefix: str, worker_id: str) -> str:
    return f"{prefix}worker:{worker_id}"


def workers_key(prefix: str) -> str:
    return f"{prefix}workers"


async def register(redis: Redis, prefix: str, info: WorkerInfo, ttl: float = DEFAULT_TTL_S) -> None:
    """Publish ``info`` for ``ttl`` seconds and list the worker in the set."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.set(worker_key(prefix, info.worker_id), info.to_json(), ex=max(1, round(ttl)))
        pipe.sadd(workers_key(prefix), info.worker_id)
        await pipe.execute()


# A heartbeat rewrites the whole record (fresh stats, fresh TTL): the same as registering.
heartbeat = register


async def deregister(redis: Redis, prefix: str, worker_id: str) -> None:
    """Remove a worker at once (graceful shutdown), rather than waiting for its TTL."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(worker_key(prefix, worker_id))
        pipe.srem(workers_key(prefix), worker_id)
        await pipe.execute()


async def live_workers(redis: Redis, prefix: str) -> list[WorkerInfo]:
    """Every worker whose key has not expired, sorted by id; expired ids leave the set."""
    ids = sorted(_text(i) for i in await redis.smembers(workers_key(prefix)))
    if not ids:
        return []
    values = await redis.mget([worker_key(prefix, i) for i in ids])
    live, dead = [], []
    for worker_id, value in zip(ids, values, strict=True):
        if value is None:
            dead.append(worker_id)
            continue
        try:
            live.append(WorkerInfo.from_json(value))
        except (ValueError, TypeError) as exc:
            logger.warning("ignoring malformed registry entry for %s: %s", worker_id, exc)
    if dead:
        await redis.srem(workers_key(prefix), *dead)
    return live


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
