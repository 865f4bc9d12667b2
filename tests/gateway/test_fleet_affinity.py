"""LoRA-affinity scoring inside a pool (the Gateway API Inference Extension's scores) and the
ranking built on it: resident first, then a free slot, then queued-to-load, then full; a hot
adapter spreads once its holders pass the load bound."""

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


def test_ranking_prefers_resident_then_free_then_loading_then_full():
    full = worker("full", [OTHER, COLD])
    loading = worker("loading", [OTHER, COLD], loading_adapters=[HOT])
    free = worker("free", [OTHER, None])
    holder = worker("holder", [HOT, OTHER], running=3)
    ranked = rank_workers([full, loading, free, holder], adapter_id=HOT)
    assert [w.worker_id for w in ranked] == ["holder", "free", "loading", "full"]


def test_equal_scores_keep_the_adapters_stable_favourite():
    pool = [worker(f"w{i}", [OTHER, None]) for i in range(4)]
    ranked = rank_workers(pool, adapter_id=COLD)
    expected = sorted(pool, key=lambda w: -rendezvous_score(COLD, w.worker_id))
    assert [w.worker_id for w in ranked] == [w.worker_id for w in expected]


def test_a_hot_adapter_spreads_to_a_free_slot_once_its_holder_is_over_the_bound():
    holder = worker("holder", [HOT, OTHER])
    free = worker("free", [COLD, None])
    full = worker("full", [COLD, OTHER])
    ranked = rank_workers([holder, free, full], adapter_id=HOT, load_factor=1.5, load_slack=4)
    assert ranked[0].worker_id == "holder"
    # Its queue grows: past least load x 1.5 + 4 it spills, to the free slot before the full.
    busy = {"holder": 5}
    ranked = rank_workers([holder, free, full], adapter_id=HOT, extra_load=busy)
    assert [w.worker_id for w in ranked] == ["free", "full", "holder"]
    # Loaded there too, the two holders share its traffic by load.
    spread = worker("free", [COLD, HOT])
    ranked = rank_workers([holder, spread, full], adapter_id=HOT, extra_load={"holder": 2})
    assert [w.worker_id for w in ranked[:2]] == ["free", "holder"]
