"""Int lists to host tensors (switchboard_kernels.host_ints) against torch.tensor."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from switchboard_kernels.host_ints import flat_ints, host_ints, ragged_rows


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
