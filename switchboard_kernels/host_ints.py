"""Python int lists to host tensors, at the speed a step's inputs need.

``torch.tensor(list)`` converts element by element through Python objects (about 70 ns
each here); ``numpy.fromiter`` over the same ints is four to five times faster, and the
tensor then shares numpy's buffer. A decode step of 128 sequences turns thousands of block
ids into tensors this way (bench/host_step.py). Lists that grow slowly and are read every
step (block tables) are ``MirroredInts``: read as arrays, never converted again.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from switchboard_kernels.mirrored_ints import MirroredInts


def int_array(values: Sequence[int], dtype: np.dtype | type = np.int64) -> np.ndarray:
    """``values`` as a 1-D array of ``dtype``, its own copy."""
    if isinstance(values, MirroredInts):
        return values.array.astype(dtype)
    return np.fromiter(values, dtype=dtype, count=len(values))


def host_ints(values: Sequence[int], dtype: np.dtype | type = np.int64) -> torch.Tensor:
    """``values`` as a 1-D host tensor of ``dtype`` (int64 by default)."""
    return torch.from_numpy(int_array(values, dtype))


def flat_ints(
    lists: Iterable[Sequence[int]], total: int, dtype: np.dtype | type = np.int64
) -> torch.Tensor:
    """The ``lists`` back to back (``total`` values in all) as one 1-D host tensor."""
    flat = _concatenated(list(lists), dtype)
    if len(flat) != total:
        raise ValueError(f"the lists hold {len(flat)} values, not {total}")
    return torch.from_numpy(flat)


def ragged_rows(lists: Sequence[Sequence[int]], dtype: np.dtype | type = np.int32) -> torch.Tensor:
    """The ``lists`` as the rows of a [len(lists), longest] host tensor, padded with 0."""
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    total = int(lengths.sum())
    width = int(lengths.max()) if len(lists) else 0
    padded = np.zeros((len(lists), width), dtype=dtype)
    if total and all(isinstance(values, MirroredInts) for values in lists):
        for row, values in zip(padded, lists, strict=True):  # a copy per row, at C speed
            row[: len(values)] = values.array
    elif total:
        flat = _concatenated(lists, dtype)
        rows = np.repeat(np.arange(len(lists)), lengths)
        columns = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        padded[rows, columns] = flat
    return torch.from_numpy(padded)


def _concatenated(lists: Sequence[Sequence[int]], dtype: np.dtype | type) -> np.ndarray:
    """The lists back to back: mirrored ones as their arrays, the others converted."""
    if not any(isinstance(values, MirroredInts) for values in lists):
        total = sum(map(len, lists))
        return np.fromiter(itertools.chain.from_iterable(lists), dtype=dtype, count=total)
    parts = [
        values.array if isinstance(values, MirroredInts) else int_array(values, dtype)
        for values in lists
    ]
    return np.concatenate(parts).astype(dtype, copy=False)
