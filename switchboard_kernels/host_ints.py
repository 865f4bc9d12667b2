"""Python int lists to host tensors, at the speed a step's inputs need.

``torch.tensor(list)`` converts element by element through Python objects (about 70 ns
each here); ``numpy.fromiter`` over the same ints is four to five times faster, and the
tensor then shares numpy's buffer. A decode step of 128 sequences turns thousands of block
ids into tensors this way (bench/host_step.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np
import torch


def host_ints(values: Sequence[int], dtype: np.dtype | type = np.int64) -> torch.Tensor:
    """``values`` as a 1-D host tensor of ``dtype`` (int64 by default)."""
    return torch.from_numpy(np.fromiter(values, dtype=dtype, count=len(values)))


def flat_ints(
    lists: Iterable[Sequence[int]], total: int, dtype: np.dtype | type = np.int64
) -> torch.Tensor:
    """The ``lists`` back to back (``total`` values in all) as one 1-D host tensor."""
    return torch.from_numpy(
        np.fromiter(itertools.chain.from_iterable(lists), dtype=dtype, count=total)
    )


def ragged_rows(lists: Sequence[Sequence[int]], dtype: np.dtype | type = np.int32) -> torch.Tensor:
    """The ``lists`` as the rows of a [len(lists), longest] host tensor, padded with 0."""
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    total = int(lengths.sum())
    width = int(lengths.max()) if len(lists) else 0
    padded = np.zeros((len(lists), width), dtype=dtype)
    if total:
        flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=dtype, count=total)
        rows = np.repeat(np.arange(len(lists)), lengths)
        columns = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        padded[rows, columns] = flat
    return torch.from_numpy(padded)
