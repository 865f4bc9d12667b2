"""Workers grouped by the base they serve: one pool per base name.

A worker names its base (``WorkerInfo.model``) and the base's content id (``base_id``). A
worker from before pools names only a model (its name or path) and no id: it belongs to the
gateway's default base when that name is one of the default base's names, and to no pool
otherwise (the gateway could not tokenize for it). Workers that give one name different
content ids (a base being replaced under its name) are split by id, and the pool serves the
id most of them run (the newest heartbeat breaks a tie), so one pool never mixes two
checkpoints' answers.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from runtime.registry import WorkerInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pool:
    """The live workers of one base."""

    base: str  # the name clients give in `model`
    base_id: str  # the content id ("" for workers that report none: the default base)
    model_path: str  # where one of its workers read the checkpoint (for the gateway's copy)
    workers: tuple[WorkerInfo, ...] = field(default=())


def base_name_of(info: WorkerInfo, *, default_base: str, default_names: frozenset[str]) -> str:
    """The base a worker serves: the default base's name for any of its aliases (its path,
    its directory's name), else the name the worker published."""
    if info.model in default_names or Path(info.model).name in default_names:
        return default_base
    return info.model


def group_pools(
    workers: Iterable[WorkerInfo], *, default_base: str, default_names: frozenset[str]
) -> dict[str, Pool]:
    """Pools by base name, each holding the workers that run its chosen content id."""
    by_name: dict[str, list[WorkerInfo]] = {}
    for w in workers:
        name = base_name_of(w, default_base=default_base, default_names=default_names)
        if not w.base_id and name != default_base:
            continue  # an older worker of a base the gateway cannot read
        by_name.setdefault(name, []).append(w)
    pools = {}
    for name, members in sorted(by_name.items()):
        chosen = _chosen_id(members)
        kept = tuple(w for w in members if w.base_id == chosen)
        if len(kept) < len(members):
            log.warning(
                "base %s: %d workers run other content than %s; not routed to",
                name, len(members) - len(kept), chosen[:12] or "(unreported)",
            )  # fmt: skip
        path = next((w.model_path for w in kept if w.model_path), "")
        pools[name] = Pool(base=name, base_id=chosen, model_path=path, workers=kept)
    return pools


def _chosen_id(members: list[WorkerInfo]) -> str:
    counts = Counter(w.base_id for w in members)
    newest = {w.base_id: w.heartbeat_at for w in sorted(members, key=lambda w: w.heartbeat_at)}
    return max(counts, key=lambda i: (counts[i], newest[i], i))
