"""Which worker serves a request: adapter and prefix affinity by rendezvous hashing,
bounded by load.

Policy (`rank_workers`, a pure function over `WorkerInfo`s):
1. Load = running + waiting (+ what this gateway sent since the heartbeat that wrote the
   worker's record and is still running).
   A worker is *within bound* while load <= least_load * load_factor + load_slack.
2. Base-model requests: least loaded first; with a prefix affinity key (below), the
   workers within bound in the key's rendezvous order instead.
3. Adapter requests, within bound: the workers holding the adapter in a slot (LoRA affinity
   1.0, `gateway.fleet.affinity`) least loaded first (or in the key's rendezvous order when
   there is one); then those where requests already wait for it to load (0.6); then the
   others in the adapter's rendezvous order — highest random weight of hash(adapter_id,
   worker_id) (Thaler & Ravishankar, 1998) — whether their slots are free or full. Then the
   workers over the bound, least loaded first.
   So each adapter has a home (its first rendezvous worker) and a stable second, third...:
   its first request on a pool goes home, where later ones will go, and the pool's adapters
   are partitioned across the workers (each worker's slots serve its own share, not every
   worker's slots the whole tail). A hot adapter spreads as its queue grows: once its
   holders pass the bound, the next request goes to its next worker, which loads it and
   becomes a holder. A worker leaving moves only the adapters whose home it was; one
   joining (its slots all free) takes over about 1/N of them, not every cold adapter.
The caller tries the first worker and, if it fails before the first token, the second.

Prefix affinity: a conversation resends its history every turn, and a worker's prefix
cache holds that history's K/V. `prefix_affinity_key` names a conversation by its tenant,
adapter and first `AFFINITY_BLOCKS` blocks of tokens, so every turn — and every gateway
replica, with no shared state — sends it to the same worker while that worker is within
bound. Prompts shorter than one block get no key; those shorter than `AFFINITY_BLOCKS`
blocks may move once as they grow, which costs little (their prefill is short).

`WorkerDirectory` reads the live list from the Redis registry at most once per `cache_s` and
groups it into one pool per base (`gateway.fleet.pools`); a request is ranked only among its
base's pool, and a base with no pool is a 503 naming it. A worker's record is as old as its last
heartbeat (every 2 s), older than the directory's reads, so a request this gateway sends counts
on top of the record's load until a record written after it arrives: dropped at every read, a
burst's sends would vanish while the record still shows the load before them, and the load bound
would let a hot adapter's workers pile up requests.
`route` is the request path's stage: the ranked workers, then a slot on the best with room
(`gateway.fair_queue`), waiting for one in fair order while every worker is saturated.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.errors import BaseUnavailableError, NoWorkerError
from gateway.fair_queue import FairQueue, Grant
from gateway.fleet.affinity import LOADING, RESIDENT, lora_affinity
from gateway.fleet.pools import Pool, group_pools
from gateway.job import Job
from runtime.registry import WorkerInfo, live_workers

log = logging.getLogger(__name__)

# The workers' KV block size, and how many leading blocks name a conversation.
AFFINITY_BLOCK_SIZE = 16
AFFINITY_BLOCKS = 4


def rendezvous_score(key: str, worker_id: str) -> int:
    """A stable pseudo-random weight of (adapter or affinity key, worker); the highest wins."""
    digest = hashlib.blake2b(f"{key}\0{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def prefix_affinity_key(
    *, tenant: str, adapter_id: str | None, prompt_ids: Sequence[int]
) -> str | None:
    """The conversation's routing key: tenant, adapter and leading full blocks of tokens."""
    num_blocks = min(len(prompt_ids) // AFFINITY_BLOCK_SIZE, AFFINITY_BLOCKS)
    if num_blocks == 0:
        return None
    h = hashlib.blake2b(digest_size=16)
    for part in (tenant, adapter_id or ""):
        h.update(part.encode() + b"\0")
    h.update(array("q", prompt_ids[: num_blocks * AFFINITY_BLOCK_SIZE]).tobytes())
    return "prefix:" + h.hexdigest()


def rank_workers(
    workers: Sequence[WorkerInfo],
    *,
    adapter_id: str | None,
    affinity_key: str | None = None,
    extra_load: dict[str, int] | None = None,
    load_factor: float = 1.5,
    load_slack: int = 4,
) -> list[WorkerInfo]:
    """All `workers`, best first, for a request on `adapter_id` (None: the base model)
    continuing the conversation `affinity_key` (None: no affinity)."""
    if not workers:
        return []
    extra = extra_load or {}

    def load(w: WorkerInfo) -> int:
        return w.running + w.waiting + extra.get(w.worker_id, 0)

    def preference(w: WorkerInfo) -> tuple:
        if affinity_key is None:
            return (load(w), w.worker_id)
        return (-rendezvous_score(affinity_key, w.worker_id),)

    by_load = sorted(workers, key=lambda w: (load(w), w.worker_id))
    if adapter_id is None and affinity_key is None:
        return by_load
    bound = load(by_load[0]) * load_factor + load_slack
    within = [w for w in workers if load(w) <= bound]
    spill = [w for w in by_load if load(w) > bound]
    if adapter_id is None:
        return sorted(within, key=preference) + spill
    scored = {w.worker_id: lora_affinity(w, adapter_id) for w in within}
    holders = sorted((w for w in within if scored[w.worker_id] == RESIDENT), key=preference)
    others = sorted(
        (w for w in within if scored[w.worker_id] != RESIDENT),
        key=lambda w: (scored[w.worker_id] != LOADING, -rendezvous_score(adapter_id, w.worker_id)),
    )
    return holders + others + spill


@dataclass
class WorkerDirectory:
    """Live workers, by base, from the registry, read again every `cache_s` seconds."""

    redis: Redis
    prefix: str
    model_names: frozenset[str]  # the default base's names (its name, path, directory name)
    heartbeat_ttl_s: float
    default_base: str = ""  # the default base's public name ("": the least of model_names)
    cache_s: float = 1.0
    load_factor: float = 1.5
    load_slack: int = 4
    clock: Callable[[], float] = time.monotonic  # the cache's time (monotonic seconds)
    wall_clock: Callable[[], float] = time.time  # sends' time, against records' heartbeat_at
    _workers: list[WorkerInfo] = field(default_factory=list)
    _pools: dict[str, Pool] = field(default_factory=dict)
    _read_at: float = float("-inf")
    # When this gateway sent each request its worker's record does not count yet (unix time,
    # against the record's heartbeat_at), and its slot while it runs: the registry's load lags
    # by up to one heartbeat, and without this a burst would all go to the same "least
    # loaded" worker. A request that ended here (its slot released) counts no more.
    _sent: dict[str, list[tuple[float, Grant | None]]] = field(default_factory=dict)
    # Workers that failed a request since the last read: skipped until the registry is read
    # again (a dead worker's record outlives it by up to one TTL).
    _failed: set[str] = field(default_factory=set)
    # One registry read at a time: requests arriving while it runs reuse its result.
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _background: asyncio.Future | None = None  # the read ahead of expiry, if one ran

    def __post_init__(self) -> None:
        self.default_base = self.default_base or min(self.model_names)

    async def workers(self) -> list[WorkerInfo]:
        """Every pool's live workers, read again every ``cache_s``: in the background while
        the list is younger than twice that (so under steady traffic no request waits for the
        registry's two round trips, milliseconds on a loaded machine), on the caller's time
        past it."""
        age = self.clock() - self._read_at
        if age >= 2 * self.cache_s:
            async with self._lock:
                if self.clock() - self._read_at >= 2 * self.cache_s:
                    await self._refresh()
        elif age >= self.cache_s and (self._background is None or self._background.done()):
            self._background = asyncio.ensure_future(self._refresh_ahead())
        return [w for w in self._workers if w.worker_id not in self._failed]

    async def pools(self) -> dict[str, Pool]:
        """The live pools by base name (as fresh as `workers`)."""
        await self.workers()
        return self._pools

    async def pool(self, base: str) -> Pool:
        """The base's pool; BaseUnavailableError naming it when none of its workers is alive."""
        found = (await self.pools()).get(base)
        if found is None or not found.workers:
            raise BaseUnavailableError(base)
        return found

    async def alive(self, base: str | None) -> bool:
        """Whether ``base``'s pool (None: the default base's) has a live worker, read from the
        registry now: after every worker tried has failed, a pool that stopped (its workers
        left the registry as they drained) is a 503 naming its base, not a worker's 502."""
        async with self._lock:
            await self._refresh()
        pool = self._pools.get(base or self.default_base)
        return pool is not None and bool(pool.workers)

    async def _refresh_ahead(self) -> None:
        async with self._lock:
            if self.clock() - self._read_at < self.cache_s:
                return  # read meanwhile
            try:
                await self._refresh()
            except RedisError as exc:  # a read on a caller's time tries again, and reports it
                log.warning("reading the worker registry in the background failed: %r", exc)

    async def _refresh(self) -> None:
        every = await live_workers(self.redis, self.prefix)
        fresh_after = self.wall_clock() - self.heartbeat_ttl_s
        fresh = [
            w
            for w in every
            # heartbeat_at 0 means "not reported": the key's TTL alone decides then.
            if w.heartbeat_at <= 0 or w.heartbeat_at >= fresh_after
        ]
        self._pools = group_pools(
            fresh, default_base=self.default_base, default_names=self.model_names
        )
        self._workers = [w for p in self._pools.values() for w in p.workers]
        self._read_at = self.clock()
        sent = {}  # the sends each worker's record does not count yet (none: unknown when)
        for w in self._workers:
            later = [
                (t, grant) for t, grant in self._pending(w.worker_id) if t > w.heartbeat_at > 0
            ]
            if later:
                sent[w.worker_id] = later
        self._sent = sent
        self._failed.clear()

    async def candidates(
        self, *, adapter_id: str | None, affinity_key: str | None = None, base: str | None = None
    ) -> list[WorkerInfo]:
        """Workers of ``base``'s pool (None: the default base) to try, best first;
        BaseUnavailableError naming the base if none is alive."""
        base = base or self.default_base
        members = (await self.pools()).get(base)
        if members is None:
            raise BaseUnavailableError(base)
        ranked = rank_workers(
            [w for w in members.workers if w.worker_id not in self._failed],
            adapter_id=adapter_id,
            affinity_key=affinity_key,
            extra_load={w: len(self._pending(w)) for w in self._sent},
            load_factor=self.load_factor,
            load_slack=self.load_slack,
        )
        if not ranked:
            raise NoWorkerError(f"no worker of the base model `{base}` is available; retry later")
        return ranked

    def sent(self, worker_id: str, grant: Grant | None = None) -> None:
        """A request went to ``worker_id``: its load until a heartbeat written after now, or
        until it ends here (``grant``, its slot, released or moved to another worker)."""
        self._sent.setdefault(worker_id, []).append((self.wall_clock(), grant))

    def _pending(self, worker_id: str) -> list[tuple[float, Grant | None]]:
        """The sends to ``worker_id`` still running there, as far as this gateway knows."""
        return [
            (t, grant)
            for t, grant in self._sent.get(worker_id, ())
            if grant is None or (not grant.released and grant.worker_id == worker_id)
        ]

    def failed(self, worker_id: str) -> None:
        self._failed.add(worker_id)


@dataclass(slots=True)
class Route:
    """Where a job goes: the workers to try, in order, and its slot on the first, which
    follows the request if it is retried on the next."""

    workers: list[WorkerInfo]
    grant: Grant
    directory: WorkerDirectory
    queue: FairQueue

    def sending(self, worker: WorkerInfo) -> None:
        """The request goes to ``worker``: its slot moves there (a retry may exceed that
        worker's bound by one), and the directory counts it until the worker's record does or
        the request ends."""
        self.queue.move(self.grant, worker.worker_id)
        self.directory.sent(worker.worker_id, self.grant)

    def failed(self, worker: WorkerInfo) -> None:
        """``worker`` is unwell: skipped until the registry is read again."""
        self.directory.failed(worker.worker_id)


async def route(job: Job, *, directory: WorkerDirectory, queue: FairQueue) -> Route:
    """The workers for ``job``, best first, and a slot on the best with room: at once, or
    after waiting in its tenant's queue while every worker is saturated. The caller
    releases the slot (`FairQueue.release`) when the request ends."""
    affinity = prefix_affinity_key(
        tenant=job.tenant, adapter_id=job.adapter_id, prompt_ids=job.prompt_ids
    )
    workers = await directory.candidates(
        adapter_id=job.adapter_id, affinity_key=affinity, base=job.base or None
    )
    grant = await queue.acquire(
        tenant=job.tenant, weight=job.tenant_weight, tokens=len(job.prompt_ids),
        workers=[w.worker_id for w in workers], deadline_s=job.remaining_s(), band=job.priority,
    )  # fmt: skip
    # The granted worker first (the best with room), then the others in rank order.
    workers.sort(key=lambda w: w.worker_id != grant.worker_id)
    return Route(workers, grant, directory, queue)
