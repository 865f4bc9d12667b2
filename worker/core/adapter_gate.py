"""Admission rule for adapter slots (S-LoRA-style): at most ``max_loras`` adapters run."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from worker.core.sequence import Sequence


class AdapterGate:
    """Admission rule for adapter slots (S-LoRA-style), rebuilt once per step."""

    def __init__(
        self, running: Iterable[Sequence], waiting: deque[Sequence], max_loras: int, max_wait: int
    ) -> None:
        self.max_loras = max_loras
        self.active = {s.adapter_id for s in running if s.adapter_id is not None}
        # The oldest request kept out too long: until its adapter gets a slot, no other
        # adapter may start a request, so the running adapters drain.
        self.starving = next(
            (
                s.adapter_id
                for s in waiting
                if s.adapter_id is not None and s.lora_wait_steps >= max_wait
            ),
            None,
        )

    def admits(self, seq: Sequence) -> bool:
        adapter = seq.adapter_id
        if adapter is None:
            return True
        if self.starving is not None and adapter != self.starving:
            return False
        return adapter in self.active or len(self.active) < self.max_loras

    def start(self, seq: Sequence) -> None:
        if seq.adapter_id is not None:
            self.active.add(seq.adapter_id)
            seq.lora_wait_steps = 0
