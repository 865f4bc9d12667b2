"""Prefix (session) affinity in the gateway's routing policy, on synthetic workers."""

from __future__ import annotations

import random
import time

from gateway.routing import AFFINITY_BLOCK_SIZE, prefix_affinity_key, rank_workers
from runtime.registry import WorkerInfo

SYSTEM = list(range(100, 180))  # 80 tokens: five blocks


def make_worker(worker_id: str, *, load: int = 0, adapters=()) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        address="127.0.0.1:1",
        model="m",
        adapters=list(adapters),
        running=load,
        heartbeat_at=time.time(),
    )


def key(prompt, *, tenant="acme", adapter=None):
    return prefix_affinity_key(tenant=tenant, adapter_id=adapter, prompt_ids=prompt)


def first(workers, **kwargs) -> str:
    return rank_workers(workers, **kwargs)[0].worker_id


def test_every_turn_of_a_conversation_has_one_key_and_others_do_not_share_it():
    turn1 = [*SYSTEM, 5, 6, 7]
    turn2 = [*turn1, 40, 41, 42, 43, 8, 9]
    assert key(turn1) == key(turn2) is not None
    assert key(turn1, tenant="globex") != key(turn1)
    assert key(turn1, adapter="sha256:a") != key(turn1)
    assert key(turn1, adapter="sha256:a") != key(turn1, adapter="sha256:b")
    assert key(list(range(AFFINITY_BLOCK_SIZE - 1))) is None  # no full block yet
    assert key([1, *SYSTEM]) != key(SYSTEM)


def test_a_conversation_sticks_to_one_worker_while_it_is_within_the_load_bound():
    workers = [make_worker(f"w{i}", load=i % 3) for i in range(5)]
    k = key(SYSTEM)
    favourite = first(workers, adapter_id=None, affinity_key=k)
    for _ in range(5):
        shuffled = random.Random(_).sample(workers, len(workers))
        assert first(shuffled, adapter_id=None, affinity_key=k) == favourite
    # Overloaded, it spills to the next in the key's order, not to the least loaded.
    hot = [make_worker(w.worker_id, load=50 if w.worker_id == favourite else 0) for w in workers]
    ranked = [w.worker_id for w in rank_workers(hot, adapter_id=None, affinity_key=k)]
    assert ranked[-1] == favourite
    without = [w for w in workers if w.worker_id != favourite]
    assert ranked[0] == first(without, adapter_id=None, affinity_key=k)


def test_conversations_spread_evenly_over_the_workers():
    workers = [make_worker(f"w{i}") for i in range(5)]
    counts: dict[str, int] = {}
    for c in range(500):
        k = key([c % 250 + 3, *SYSTEM], tenant=f"t{c // 250}")
        chosen = first(workers, adapter_id=None, affinity_key=k)
        counts[chosen] = counts.get(chosen, 0) + 1
    assert all(60 <= n <= 140 for n in counts.values()), counts


def test_adapter_holders_still_come_first_ordered_by_the_conversation():
    workers = [
        make_worker("a", adapters=["x"]),
        make_worker("b", adapters=["x"]),
        make_worker("c"),
        make_worker("d"),
    ]
    seen = set()
    for c in range(40):
        ranked = rank_workers(workers, adapter_id="x", affinity_key=key([c, *SYSTEM], adapter="x"))
        assert {w.worker_id for w in ranked[:2]} == {"a", "b"}
        seen.add(ranked[0].worker_id)
    assert seen == {"a", "b"}  # conversations spread over the holders


def test_without_a_key_the_policy_is_unchanged():
    workers = [make_worker("a", load=3), make_worker("b", load=1)]
    assert first(workers, adapter_id=None, affinity_key=None) == "b"
