"""A list of ints that is also an array: for lists read whole far more often than changed.

numpy only (no torch), so the engine's bookkeeping (``worker.core.sequence``) can hold one.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class MirroredInts(list):
    """A ``list`` of ints that keeps an int32 array of itself current through every change.

    A sequence's block table grows by one id every block_size tokens and is read whole at
    every step: converting every id again cost ~25 ns an id (0.4 ms a step for 128 tables of
    2,048 tokens' blocks), reading the array costs a slice. Appending and setting one item
    update the array in place; rarer changes rebuild it.
    """

    __slots__ = ("_mirror",)

    def __init__(self, values: Iterable[int] = ()) -> None:
        super().__init__(values)
        self._rebuild()

    @property
    def array(self) -> np.ndarray:
        """The values as int32: a view, to be read before the list next changes."""
        return self._mirror[: len(self)]

    def append(self, value: int) -> None:
        n = len(self)
        if n == len(self._mirror):
            grown = np.empty(2 * n, dtype=np.int32)
            grown[:n] = self._mirror
            self._mirror = grown
        self._mirror[n] = value  # first: a value int32 cannot hold changes nothing
        super().append(value)

    def __setitem__(self, index, value) -> None:
        if isinstance(index, int):
            self[index]  # an index out of range raises here, before any change
            self._mirror[index % len(self)] = value  # from the end of the list, not the array
            super().__setitem__(index, value)
        else:
            super().__setitem__(index, value)
            self._rebuild()

    def copy(self) -> MirroredInts:
        return MirroredInts(self)

    def __reduce__(self):
        return MirroredInts, (list(self),)

    def _rebuild(self) -> None:
        mirror = np.empty(max(16, 2 * len(self)), dtype=np.int32)
        mirror[: len(self)] = np.fromiter(self, dtype=np.int32, count=len(self))
        self._mirror = mirror

    # The rarer changes: the list's own, then the array rebuilt.

    def extend(self, values: Iterable[int]) -> None:
        super().extend(values)
        self._rebuild()

    def insert(self, index, value) -> None:
        super().insert(index, value)
        self._rebuild()

    def pop(self, index=-1):
        value = super().pop(index)
        self._rebuild()
        return value

    def remove(self, value) -> None:
        super().remove(value)
        self._rebuild()

    def clear(self) -> None:
        super().clear()
        self._rebuild()

    def sort(self, *, key=None, reverse=False) -> None:
        super().sort(key=key, reverse=reverse)
        self._rebuild()

    def reverse(self) -> None:
        super().reverse()
        self._rebuild()

    def __delitem__(self, index) -> None:
        super().__delitem__(index)
        self._rebuild()

    def __iadd__(self, values):
        super().__iadd__(values)
        self._rebuild()
        return self

    def __imul__(self, times):
        super().__imul__(times)
        self._rebuild()
        return self
