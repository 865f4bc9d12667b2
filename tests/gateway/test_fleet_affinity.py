"""LoRA-affinity scoring inside a pool (the Gateway API Inference Extension's scores) and the
ranking built on it: resident first, then queued-to-load, then the adapter's rendezvous order
(its home first); scripted pools whose slots fill as requests land: an adapter goes home and
stays, spills to its next worker only over the load bound, and a worker leaving or joining
moves only the adapters whose home changes."""

from __future__ import annotations

from gateway.fleet.affinity import FREE_SLOT, FULL, LOADING, RESIDENT, lora_affinity
from gateway.routing import rank_workers, rendezvous_score
from runtime.registry import WorkerInfo

HOT, COLD, OTHER = "a" * 64, "b" * 64, "c" * 64


def worker(name: str, slots: list[str | None], *, running: int = 0, **fields) -> WorkerInfo:
    return WorkerInfo(
        worker_id=name, address=f"{name}:1", model="m", slot_adapters=slots, running=running,
        **fields,
    )  # fmt: skip


def test_scores_follow_the_inference_extension():
    assert lora_affinity(worker("w", [HOT, None]), HOT) == RESIDENT == 1.0
    # In the host cache only: moving it into a slot evicts the other adapter.
    assert lora_affinity(worker("w", [OTHER], adapters=[HOT]), HOT) == FULL
    assert lora_affinity(worker("w", [], adapters=[HOT]), HOT) == RESIDENT  # no slots reported
    assert lora_affinity(worker("w", [OTHER, None]), HOT) == FREE_SLOT == 0.8
    assert lora_affinity(worker("w", [OTHER], loading_adapters=[HOT]), HOT) == LOADING == 0.6
    assert lora_affinity(worker("w", [OTHER, COLD]), HOT) == FULL == 0.0
    assert lora_affinity(worker("w", []), HOT) == FREE_SLOT  # slots not reported: neutral


def home_order(adapter: str, names) -> list[str]:
    """The adapter's rendezvous order over ``names``: home first."""
    return sorted(names, key=lambda n: -rendezvous_score(adapter, n))


def test_ranking_is_resident_then_loading_then_the_adapters_home_order():
    full = worker("full", [OTHER, COLD])
    free = worker("free", [OTHER, None])
    loading = worker("loading", [OTHER, COLD], loading_adapters=[HOT])
    holder = worker("holder", [HOT, OTHER], running=3)
    ranked = rank_workers([full, loading, free, holder], adapter_id=HOT)
    # A free slot does not outrank a full worker: the rest follow HOT's rendezvous order.
    rest = home_order(HOT, ["full", "free"])
    assert [w.worker_id for w in ranked] == ["holder", "loading", *rest]


def test_equal_scores_keep_the_adapters_stable_favourite():
    pool = [worker(f"w{i}", [OTHER, None]) for i in range(4)]
    ranked = rank_workers(pool, adapter_id=COLD)
    assert [w.worker_id for w in ranked] == home_order(COLD, [f"w{i}" for i in range(4)])


class SlotPool:
    """Workers with LRU adapter slots, as the gateway sees them after each request lands."""

    def __init__(self, names, slots: int = 4) -> None:
        self.slots = {n: [] for n in names}  # most recently used last
        self.size = slots
        self.running = dict.fromkeys(names, 0)

    def infos(self) -> list[WorkerInfo]:
        return [
            worker(n, held + [None] * (self.size - len(held)), running=self.running[n])
            for n, held in self.slots.items()
        ]

    def send(self, adapter: str, **kwargs) -> str:
        chosen = rank_workers(self.infos(), adapter_id=adapter, **kwargs)[0].worker_id
        held = self.slots[chosen]
        if adapter in held:
            held.remove(adapter)
        elif len(held) == self.size:
            held.pop(0)
        held.append(adapter)
        return chosen


def test_an_adapters_first_request_goes_home_and_later_ones_follow():
    names = ["w0", "w1", "w2"]
    adapters = [f"{i:064x}" for i in range(9)]
    home = {a: home_order(a, names)[0] for a in adapters}
    pool = SlotPool(names)
    # Fill every slot but one with other adapters; the free one is never on HOT's home.
    for n in names:
        pool.slots[n] = [f"{n}-{i}" for i in range(4)]
    pool.slots[home_order(HOT, names)[1]].pop(0)
    assert pool.send(HOT) == home_order(HOT, names)[0]
    # Requests within the bound keep going to the worker that holds it, every time.
    for _ in range(20):
        assert pool.send(HOT) == home_order(HOT, names)[0]
    # The pool's adapters are partitioned: each lands on its home and stays there.
    for round_ in range(3):
        for a in adapters:
            assert pool.send(a) == home[a], (round_, a)


def test_a_hot_adapter_spills_to_its_next_worker_only_over_the_bound():
    names = ["w0", "w1", "w2"]
    first, second, third = home_order(HOT, names)
    pool = SlotPool(names)
    assert pool.send(HOT) == first
    # least load 0: the bound is 0 x 1.5 + 4, so 4 requests there still stay, a fifth spills.
    pool.running[first] = 4
    assert pool.send(HOT, load_factor=1.5, load_slack=4) == first
    pool.running[first] = 5
    assert pool.send(HOT, load_factor=1.5, load_slack=4) == second
    # Now held on two workers: the less loaded holder takes it; the third stays out.
    pool.running[second] = 2
    assert pool.send(HOT) == second
    pool.running[first] = 1
    assert pool.send(HOT) == first
    assert HOT not in pool.slots[third]
    # Both holders past the bound: the third worker, then both holders by load.
    ranked = rank_workers(pool.infos(), adapter_id=HOT, extra_load={first: 9, second: 10})
    assert [w.worker_id for w in ranked] == [third, first, second]


def test_a_worker_leaving_moves_only_the_adapters_it_was_home_to():
    names = [f"w{i}" for i in range(5)]
    adapters = [f"{i:064x}" for i in range(200)]
    full = {n: worker(n, [OTHER, COLD]) for n in names}
    before = {a: rank_workers(list(full.values()), adapter_id=a)[0].worker_id for a in adapters}
    left = [full[n] for n in names if n != "w2"]
    after = {a: rank_workers(left, adapter_id=a)[0].worker_id for a in adapters}
    moved = {a for a in adapters if before[a] != after[a]}
    assert moved == {a for a in adapters if before[a] == "w2"}
    assert 0.1 * len(adapters) <= len(moved) <= 0.3 * len(adapters)  # about 1/5
    # Each moved adapter goes to its second choice: the same one every replica computes.
    assert all(after[a] == home_order(a, names)[1] for a in moved)
    # A worker joining takes over only adapters that now call it home.
    joined = [*full.values(), worker("w5", [None, None])]
    again = {a: rank_workers(joined, adapter_id=a)[0].worker_id for a in adapters}
    taken = {a for a in adapters if again[a] != before[a]}
    assert taken == {a for a in adapters if again[a] == "w5"}
    assert 0.08 * len(adapters) <= len(taken) <= 0.25 * len(adapters)  # about 1/6, not all
