"""A batch's life as one state machine, written once here: its states (OpenAI's `status`), the
transitions allowed between them, and the one Lua script that takes a transition in Redis.

    validating ──▶ in_progress ──▶ finalizing ──▶ completed
        │  │            │  │
        │  └──▶ failed  │  └──▶ expired          (the completion window ran out)
        └───────────────┴──▶ cancelling ──▶ cancelled

A transition is atomic and checked against the stored state (a runner that lost its lease,
or a cancel racing the runner, cannot take a transition from a state the batch has left), and
stamps the new state's `<status>_at` time with the fields that go with it (the output files,
the counts). Whatever a process dies between, the stored state says what is left to do, and
each state's work is idempotent (`gateway.batch.runner`).
"""

from __future__ import annotations

import enum
import json
import time

import redis.asyncio as aioredis


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return not TRANSITIONS[self]

    @property
    def stamp(self) -> str:
        """The batch's field holding when it entered this state (`in_progress_at`, …)."""
        return f"{self.value}_at"


S = BatchStatus
TRANSITIONS: dict[BatchStatus, frozenset[BatchStatus]] = {
    S.VALIDATING: frozenset({S.IN_PROGRESS, S.FAILED, S.CANCELLING}),
    S.IN_PROGRESS: frozenset({S.FINALIZING, S.EXPIRED, S.CANCELLING}),
    S.FINALIZING: frozenset({S.COMPLETED}),
    S.CANCELLING: frozenset({S.CANCELLED}),
    S.FAILED: frozenset(),
    S.COMPLETED: frozenset(),
    S.EXPIRED: frozenset(),
    S.CANCELLED: frozenset(),
}


class TransitionRefused(Exception):
    """The stored batch is not in a state the transition leaves from."""

    def __init__(self, current: BatchStatus | None, target: BatchStatus) -> None:
        super().__init__(f"batch is {current}, not a state that goes to {target}")
        self.current = current
        self.target = target


def allowed(current: BatchStatus, target: BatchStatus) -> bool:
    return target in TRANSITIONS[current]


# The table above as Lua sees it: {"validating": {"in_progress": true, …}, …}.
_LUA_TABLE = json.dumps({s.value: {t.value: True for t in TRANSITIONS[s]} for s in S})

# KEYS: 1 batch record; ARGV: 1 target, 2 its stamp field, 3 now, 4 the table, 5.. field
# pairs. Returns the state it left, or
# {err = current} when the table has no such edge.
TRANSITION = """
local table_ = cjson.decode(ARGV[4])
local current = redis.call('HGET', KEYS[1], 'status')
if not current or not table_[current][ARGV[1]] then
  return {0, current or ''}
end
local fields = {'status', ARGV[1], ARGV[2], ARGV[3]}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
return {1, current}
"""


class StateMachine:
    """Takes transitions on stored batches (`{prefix}{tenant}:batch:<id>` hashes); the
    active set lists the batches not yet in a final state, for runners to find (a batch
    found there in a final state, left by a process that died after its last transition, is
    taken out by the runner)."""

    def __init__(self, redis: aioredis.Redis, *, active_key: str) -> None:
        self.redis = redis
        self.active_key = active_key
        self._script = redis.register_script(TRANSITION)

    async def move(
        self,
        key: str,
        member: str,
        target: BatchStatus,
        *,
        fields: dict[str, str | int] | None = None,
        now: int | None = None,
    ) -> BatchStatus:
        """Take the batch at ``key`` to ``target``, with ``fields``; returns the state it
        left. Raises `TransitionRefused` when the stored state has no edge to ``target``."""
        stamp = int(time.time()) if now is None else now
        pairs = [x for k, v in (fields or {}).items() for x in (k, str(v))]
        args = [target.value, target.stamp, stamp, _LUA_TABLE, *pairs]
        taken, current = await self._script(keys=[key], args=args)
        previous = BatchStatus(current) if current else None
        if not taken:
            raise TransitionRefused(previous, target)
        assert previous is not None
        if target.final:
            await self.redis.srem(self.active_key, member)
        return previous
