"""A request's weighted mix of adapters: ``sum_k w_k * delta_k``, each adapter in its own slot.

The engine resolves the names to content ids and builds one ``AdapterMix``; its ``key`` stands
in for an adapter id wherever a request's adapter is an identity (the prefix cache's root, so a
mix shares KV with no single adapter and no other mix), and ``ids`` are the slots it needs.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from worker.errors import InvalidRequestError

# At most this many adapters in one mix (each holds a device slot while the request runs); the
# engine also bounds it by its slots, so a mix can always be admitted once others drain.
MAX_MIX_ADAPTERS = 8


@dataclass(frozen=True, slots=True)
class AdapterMix:
    """(content id, weight) parts, sorted by id: the same mix always computes the same way."""

    parts: tuple[tuple[str, float], ...]

    @classmethod
    def of(cls, parts: Sequence[tuple[str, float]], *, max_adapters: int) -> AdapterMix:
        """Checked parts: 1 to ``max_adapters`` distinct ids, finite weights >= 0."""
        if not 1 <= len(parts) <= max_adapters:
            raise InvalidRequestError(
                f"a mix names 1 to {max_adapters} adapters; this one names {len(parts)}"
            )
        ids = [i for i, _ in parts]
        if len(set(ids)) != len(ids):
            raise InvalidRequestError("a mix names each adapter at most once")
        for adapter_id, weight in parts:
            if not (isinstance(weight, float | int) and math.isfinite(weight) and weight >= 0):
                raise InvalidRequestError(
                    f"a mix's weights must be finite and >= 0; got {weight!r} for {adapter_id}"
                )
        return cls(tuple(sorted((i, float(w)) for i, w in parts)))

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(i for i, _ in self.parts)

    @property
    def key(self) -> str:
        """Stands for the mix where one adapter's content id would: its ids and exact weights."""
        text = ";".join(f"{i}*{w.hex()}" for i, w in self.parts)
        return "mix:" + hashlib.sha256(text.encode()).hexdigest()
