"""The adapter slots' eviction rule (`worker.model.slot_eviction`): scripted scenarios with
hand-computed heats, no model."""

from __future__ import annotations

import pytest

from worker.model.slot_eviction import SlotEviction


def make_eviction(arrivals: list[str], *, half_life: float = 2.0, finished: bool = True):
    """A worker's rule after one request on each of ``arrivals`` in order, every one of them
    finished (``finished``) or still open."""
    rule = SlotEviction(half_life=half_life)
    for adapter in arrivals:
        rule.arrived([adapter])
        if finished:
            rule.left([adapter])
    return rule


def test_an_empty_slot_is_taken_first():
    rule = make_eviction(["a", "b"])
    assert rule.victim(["a", None, "b"], [1, 9, 2], needed={"c"}) == 1


def test_without_counts_the_least_recently_used_slot_goes():
    rule = SlotEviction()
    assert rule.victim(["a", "b", "c"], [5, 3, 7], needed={"d"}) == 1


def test_a_popular_adapter_outlives_a_cold_one_used_since():
    # half-life 2 arrivals, clock at 4: a came at 1 and 2, b at 3, c at 4.
    # a: (2^-1/2 + 1) * 2^-1 = 0.854; b: 2^-1/2 = 0.707; c: 1.
    rule = make_eviction(["a", "a", "b", "c"])
    assert rule.heat("a") == pytest.approx((0.5**0.5 + 1) * 0.5)
    assert rule.heat("b") == pytest.approx(0.5**0.5)
    assert rule.heat("c") == pytest.approx(1.0)
    # a's slot was used longest ago (LRU would take it); b is the coldest.
    assert rule.victim(["a", "b", "c"], [1, 5, 6], needed={"d"}) == 1


def test_the_step_s_adapters_are_never_evicted():
    rule = make_eviction(["a", "a", "a", "b"])  # b is the coldest
    assert rule.victim(["a", "b", "c"], [1, 2, 3], needed={"b", "c", "d"}) == 0
    assert rule.victim(["a", "b"], [1, 2], needed={"b", "d"}) == 0


def test_an_adapter_with_queued_requests_goes_last():
    rule = make_eviction(["a", "b", "c", "c", "c"], half_life=8.0)  # c the hottest, a the coldest
    rule.arrived(["a"])  # queued, not in this step
    assert rule.victim(["a", "b", "c"], [1, 2, 3], needed={"d"}) == 1
    rule.arrived(["b"])  # now only c, the hottest, has none queued: it goes
    assert rule.heat("c") > max(rule.heat("a"), rule.heat("b"))
    assert rule.victim(["a", "b", "c"], [1, 2, 3], needed={"d"}) == 2
    # Every candidate has a queued request: the coldest of them.
    rule.arrived(["c"])
    heats = {a: rule.heat(a) for a in "abc"}
    assert rule.victim(["a", "b", "c"], [1, 2, 3], needed={"d"}) == "abc".index(
        min(heats, key=heats.__getitem__)
    )


def test_an_adapter_stays_open_until_each_of_its_samples_left():
    rule = SlotEviction()
    rule.arrived(["a"], sequences=2)
    rule.left(["a"])
    assert rule.open["a"] == 1
    rule.left(["a"])
    assert "a" not in rule.open
    # A mix's request opens each of its adapters.
    rule.arrived(["a", "b"])
    assert rule.open == {"a": 1, "b": 1}


def test_heat_outlives_the_slot_and_ages():
    # a: four requests at 1-4 -> 2.561 at 4; b: two at 5 and 6 -> 1.707 at 6, when a has
    # halved to 1.280. Plain LFU (4 against 2) would keep a; the aged counts keep b.
    rule = make_eviction(["a"] * 4 + ["b"] * 2)
    a_at_4 = ((1 * 0.5**0.5 + 1) * 0.5**0.5 + 1) * 0.5**0.5 + 1
    assert rule.heat("a") == pytest.approx(a_at_4 * 0.5)
    assert rule.heat("b") == pytest.approx(0.5**0.5 + 1)
    assert rule.victim(["a", "b"], [4, 6], needed={"c"}) == 0
    # Not resident, a keeps its count: three requests on c later it is an eighth of 2.561...
    for _ in range(3):
        rule.arrived(["c"])
        rule.left(["c"])
    assert rule.heat("a") == pytest.approx(a_at_4 * 0.5**2.5)


def test_a_count_decayed_below_a_sixteenth_is_forgotten():
    rule = make_eviction(["a"], half_life=2.0)
    # Counts below 1/16 are dropped every half-life (2 arrivals): a's 1 is 1/16 at 9 (kept),
    # 2^-4.5 at 10 (dropped).
    for _ in range(8):
        rule.arrived(["b"])
        rule.left(["b"])
    assert rule.heat("a") == pytest.approx(1 / 16)
    for _ in range(1):
        rule.arrived(["b"])
        rule.left(["b"])
    assert rule.heat("a") == 0.0 and "a" not in rule._heat
    assert rule.heat("b") > 1


def test_a_forgotten_count_is_kept_while_requests_are_open():
    rule = make_eviction(["a"], half_life=2.0, finished=False)
    for _ in range(12):
        rule.arrived(["b"])
    assert "a" in rule._heat and rule.heat("a") == pytest.approx(0.5**6)


def test_the_half_life_must_be_positive():
    with pytest.raises(ValueError):
        SlotEviction(half_life=0)
