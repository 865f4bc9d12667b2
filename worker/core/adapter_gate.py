"""Admission rule for adapter slots (S-LoRA-style): at most ``max_loras`` adapters run."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from worker.core.sequence import Sequence


class AdapterGate:
    """Admission rule for adapter slots (S-LoRA-style), rebuilt once per step.

    A request holds a slot for each adapter it runs with: one, or each adapter of its mix
    (``Sequence.adapter_ids``). It starts only if the running adapters and its own fit in
    ``max_loras`` together, so a step never needs more slots than there are."""

    def __init__(
        self, running: Iterable[Sequence], waiting: deque[Sequence], max_loras: int, max_wait: int
    ) -> None:
        self.max_loras = max_loras
        self.active = {a for s in running for a in s.adapter_ids}
        # The oldest request kept out too long: until its adapters get slots, no request
        # needing another adapter may start, so the running ones drain and it fits (a mix
        # is never larger than max_loras: the engine refuses it).
        self.starving: frozenset[str] | None = next(
            (
                frozenset(s.adapter_ids)
                for s in waiting
                if s.adapter_ids and s.lora_wait_steps >= max_wait
            ),
            None,
        )

    def admits(self, seq: Sequence) -> bool:
        needed = seq.adapter_ids
        if not needed:
            return True
        if self.starving is not None and not self.starving.issuperset(needed):
            return False
        return len(self.active.union(needed)) <= self.max_loras

    def start(self, seq: Sequence) -> None:
        if seq.adapter_ids:
            self.active.update(seq.adapter_ids)
            seq.lora_wait_steps = 0
