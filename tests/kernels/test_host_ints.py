"""Int lists to host tensors (switchboard_kernels.host_ints) against torch.tensor, and the
lists that keep their own array (MirroredInts) against plain lists."""

from __future__ import annotations

import copy
import pickle
import random

import numpy as np
import pytest
import torch

from switchboard_kernels.attention_native import NativeDecodes
from switchboard_kernels.host_ints import flat_ints, host_ints, ragged_rows
from switchboard_kernels.mirrored_ints import MirroredInts


@pytest.mark.parametrize("seed", range(5))
def test_the_conversions_match_torch_tensor(seed: int) -> None:
    rng = random.Random(seed)
    lists = [[rng.randrange(-(2**40), 2**40) for _ in range(rng.randrange(0, 9))] for _ in range(7)]
    values = lists[0] + lists[1]
    assert torch.equal(host_ints(values), torch.tensor(values, dtype=torch.int64))
    flat = [v for values in lists for v in values]
    assert torch.equal(flat_ints(lists, len(flat)), torch.tensor(flat, dtype=torch.int64))
    small = [[v % 30_000 for v in values] for values in lists]
    width = max(len(values) for values in small)
    expected = torch.tensor([values + [0] * (width - len(values)) for values in small])
    got = ragged_rows(small)
    assert got.dtype == torch.int32 and torch.equal(got, expected.to(torch.int32))


def test_empty_inputs() -> None:
    assert host_ints([]).shape == (0,)
    assert flat_ints([[], []], 0).shape == (0,)
    assert ragged_rows([]).shape == (0, 0)
    assert ragged_rows([[], []]).shape == (2, 0)
    assert host_ints([1, 2], np.int32).dtype == torch.int32


def test_a_wrong_total_is_refused() -> None:
    with pytest.raises(ValueError):
        flat_ints([[1, 2], [3]], 4)
    with pytest.raises(ValueError):
        flat_ints([MirroredInts([1, 2]), [3]], 4)


def _changes(rng: random.Random):
    """Random changes a list can take, each as a function of the list."""
    value = rng.randrange(1000)
    index = rng.randrange(-3, 3)
    yield from [
        lambda t: t.append(value),
        lambda t: t.append(value),
        lambda t: t.append(value),
        # An index in range, from the front or (odd values) from the end.
        lambda t: t.__setitem__(index % len(t) - len(t) * (value % 2), value) if t else None,
        lambda t: t.__setitem__(slice(1, 3), [value, value, value]),
        lambda t: t.__delitem__(slice(index, None)),
        lambda t: t.__delitem__(0) if t else None,
        lambda t: t.extend([value, value + 1]),
        lambda t: t.insert(index, value),
        lambda t: t.pop() if t else None,
        lambda t: t.remove(t[0]) if t else None,
        lambda t: t.sort(reverse=value % 2 == 0),
        lambda t: t.reverse(),
        lambda t: t.__iadd__([value]),
        lambda t: t.__imul__(value % 3),
        lambda t: t.clear() if value % 7 == 0 else None,
    ]


@pytest.mark.parametrize("seed", range(4))
def test_a_mirrored_list_keeps_its_array_equal_to_a_plain_list_through_every_change(seed: int):
    rng = random.Random(seed)
    mirrored, plain = MirroredInts(), []
    for _ in range(400):
        change = rng.choice(list(_changes(rng)))
        change(mirrored)
        change(plain)
        assert mirrored == plain and mirrored.array.tolist() == plain
        assert type(mirrored) is MirroredInts and mirrored.array.dtype == np.int32
    for twin in (mirrored.copy(), copy.deepcopy(mirrored), pickle.loads(pickle.dumps(mirrored))):
        assert type(twin) is MirroredInts and twin == plain and twin.array.tolist() == plain
        twin.append(5)
        assert mirrored == plain  # a twin of its own


def test_a_value_int32_cannot_hold_changes_nothing():
    table = MirroredInts(range(16))  # a full array: the append would grow it first
    with pytest.raises(OverflowError):
        table.append(2**40)
    with pytest.raises(OverflowError):
        table[-1] = 2**40
    assert table == list(range(16)) and table.array.tolist() == list(range(16))


@pytest.mark.parametrize("seed", range(3))
def test_mirrored_lists_convert_as_plain_lists_do(seed: int):
    rng = random.Random(seed)
    plain = [[rng.randrange(30_000) for _ in range(rng.randrange(0, 40))] for _ in range(9)]
    mixed = [MirroredInts(t) if i % 2 else t for i, t in enumerate(plain)]
    total = sum(map(len, plain))
    assert torch.equal(flat_ints(mixed, total), flat_ints(plain, total))
    assert torch.equal(ragged_rows(mixed), ragged_rows(plain))
    every = [MirroredInts(t) for t in [*plain, []]]
    assert torch.equal(ragged_rows(every), ragged_rows([*plain, []]))
    assert torch.equal(host_ints(mixed[1], np.int32), host_ints(plain[1], np.int32))
    tables = [t for t in plain if t]
    queries = [1] * len(tables)
    starts = [len(t) * 2 - 1 for t in tables]
    want = NativeDecodes.build(starts, queries, tables)
    got = NativeDecodes.build(starts, queries, [MirroredInts(t) for t in tables])
    assert got.max_block == want.max_block == max(map(max, tables))
    for name in ("rows", "queries", "starts", "table_starts", "own_slots", "tables"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    mirrored = MirroredInts([1, 2])
    array = host_ints(mirrored)
    mirrored[0] = 9  # the tensor is a copy, not a view of the list's array
    assert array.tolist() == [1, 2]
