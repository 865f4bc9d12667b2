"""bench/slot_model.py against hand-counted sequences and, for the lower bound, against an
exhaustive search over every eviction choice."""

from __future__ import annotations

import functools
import random

from bench.slot_model import belady_cost, heat_cost, lfu_cost, lru_cost, replay


def test_lru_counts_first_loads_and_refills_by_hand():
    # 2 slots: a b (loads) a (hit) c (evicts b) b (evicts a) a (evicts c)
    cost = lru_cost("abacba", 2)
    assert (cost.store_loads, cost.slot_refills) == (3, 3)
    assert cost.per_1k(6) == 1000.0


def test_belady_evicts_the_adapter_needed_furthest_ahead_by_hand():
    # 2 slots: a b, c evicts b (a is needed first), b evicts c (never again), a hits
    cost = belady_cost("abacba", 2)
    assert (cost.store_loads, cost.slot_refills) == (3, 2)


def test_lfu_keeps_the_frequent_adapter_by_hand():
    # 2 slots: a a b (loads), c evicts b (1 use; a has 2), a hits. LRU evicts a for c (a's
    # last use is older than b's) and then b for a.
    assert (lfu_cost("aabca", 2).store_loads, lfu_cost("aabca", 2).slot_refills) == (3, 1)
    assert lru_cost("aabca", 2).slot_refills == 2
    # Equal counts: the least recently used of them goes (a b a b c: a, then c for a).
    assert lfu_cost("ababca", 2).slot_refills == 2


def test_the_workers_rule_keeps_the_frequent_adapter_by_hand():
    # As LFU above: 2 slots, a a b, c evicts b (a is hotter), a hits.
    assert (heat_cost("aabca", 2).store_loads, heat_cost("aabca", 2).slot_refills) == (3, 1)
    # Equal counts age: a b a b c: b's requests are the later ones, so a goes; then a for c.
    assert heat_cost("ababca", 2).slot_refills == 2


def fewest_fills(sequence: str, slots: int) -> int:
    """Every choice of victim tried: the fewest fills that serve ``sequence``."""

    @functools.cache
    def best(i: int, held: frozenset[str]) -> int:
        if i == len(sequence):
            return 0
        a = sequence[i]
        if a in held:
            return best(i + 1, held)
        if len(held) < slots:
            return 1 + best(i + 1, held | {a})
        return 1 + min(best(i + 1, held - {v} | {a}) for v in held)

    return best(0, frozenset())


def test_belady_is_the_fewest_fills_of_any_eviction_choice():
    rng = random.Random(0)
    for _ in range(200):
        slots = rng.choice([1, 2, 3])
        sequence = "".join(rng.choice("abcde") for _ in range(rng.randint(1, 12)))
        cost = belady_cost(sequence, slots)
        fills = cost.slot_refills + min(slots, len(set(sequence)))
        assert fills == fewest_fills(sequence, slots), sequence
        assert cost.loads <= lru_cost(sequence, slots).loads


def test_replay_counts_each_worker_its_own_slots():
    log = [("a", "w0"), ("b", "w1"), ("c", "w0"), ("a", "w0"), ("a", "w1"), ("b", "w1")]
    out = replay(log, 1, stretches=2)
    # w0: a, c (refill), a (refill); w1: b, a (store + refill), b (refill)
    assert (out.total.store_loads, out.total.slot_refills) == (4, 4)
    assert {w: (c.store_loads, c.slot_refills) for w, c in out.by_worker.items()} == {
        "w0": (2, 2), "w1": (2, 2),
    }  # fmt: skip
    assert {a: (c.store_loads, c.slot_refills) for a, c in out.by_adapter.items()} == {
        "a": (2, 2), "b": (1, 1), "c": (1, 1),
    }  # fmt: skip
    assert [(c.store_loads, c.slot_refills) for c in out.by_stretch] == [(3, 1), (1, 3)]


def test_one_worker_replay_is_one_cache():
    sequence = [random.Random(1).randrange(6) for _ in range(100)]
    for slots in (1, 3):
        out = replay([(a, "w") for a in sequence], slots)
        assert out.total == heat_cost(sequence, slots)
        assert replay([(a, "w") for a in sequence], slots, rule="lru").total == lru_cost(
            sequence, slots
        )
        assert sum(out.loaded) == out.total.slot_refills + min(slots, len(set(sequence)))
