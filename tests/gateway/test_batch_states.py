"""The batch state machine (gateway/batch/states.py) on the real Redis: every edge of the table
taken, every other refused against the stored state, stamps and fields written with it."""

from __future__ import annotations

import itertools

import pytest

from gateway.batch.states import TRANSITIONS, BatchStatus, StateMachine, TransitionRefused

S = BatchStatus


async def stored(redis_client, key: str, status: BatchStatus) -> None:
    await redis_client.delete(key)
    await redis_client.hset(key, mapping={"id": "b", "status": status.value})


def test_the_table_is_openais_life_of_a_batch():
    finals = {s for s in S if s.final}
    assert finals == {S.FAILED, S.COMPLETED, S.EXPIRED, S.CANCELLED}
    reachable = {S.VALIDATING}
    frontier = [S.VALIDATING]
    while frontier:
        for target in TRANSITIONS[frontier.pop()]:
            if target not in reachable:
                reachable.add(target)
                frontier.append(target)
    assert reachable == set(S)  # every state reachable from validating
    assert all(not TRANSITIONS[s] for s in finals)


@pytest.mark.parametrize("current,target", list(itertools.product(S, S)))
async def test_each_transition_is_taken_exactly_when_the_table_has_it(
    redis_client, redis_prefix, current, target
):
    machine = StateMachine(redis_client, active_key=redis_prefix + "active")
    key = redis_prefix + "batch"
    await stored(redis_client, key, current)
    await redis_client.sadd(machine.active_key, "t\0b")
    if target in TRANSITIONS[current]:
        left = await machine.move(key, "t\0b", target, fields={"total": 3}, now=1234)
        assert left is current
        fields = await redis_client.hgetall(key)
        assert fields["status"] == target.value
        assert fields[target.stamp] == "1234" and fields["total"] == "3"
        assert await redis_client.sismember(machine.active_key, "t\0b") == (not target.final)
    else:
        with pytest.raises(TransitionRefused) as refused:
            await machine.move(key, "t\0b", target)
        assert refused.value.current is current
        assert (await redis_client.hgetall(key))["status"] == current.value


async def test_a_missing_batch_takes_no_transition(redis_client, redis_prefix):
    machine = StateMachine(redis_client, active_key=redis_prefix + "active")
    with pytest.raises(TransitionRefused) as refused:
        await machine.move(redis_prefix + "gone", "t\0gone", S.IN_PROGRESS)
    assert refused.value.current is None
    assert not await redis_client.exists(redis_prefix + "gone")
