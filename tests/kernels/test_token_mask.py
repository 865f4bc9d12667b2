"""switchboard_kernels/token_mask.py: a packed bitmask applied to logits rows, natively and in
torch, against a per-token loop over the bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from switchboard_kernels import token_mask
from switchboard_kernels.token_mask import apply_token_bitmask_

KERNEL = token_mask._native_kernel()


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    if request.param == "native" and KERNEL is None:
        pytest.skip("no C compiler: kernel not built")
    if request.param == "torch":
        monkeypatch.setattr(token_mask, "_native_kernel", lambda: None)
    return request.param


def expected(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> torch.Tensor:
    """Token by token: -inf where the token's bit is clear, in the listed rows only."""
    want = logits.clone()
    for i, row in enumerate(rows):
        for token in range(logits.shape[1]):
            if not (int(bitmask[i, token // 32]) >> (token % 32)) & 1:
                want[row, token] = float("-inf")
    return want


def random_bitmask(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """Words of every kind: all allowed, none allowed, a few bits, random bits."""
    words = (vocab + 31) // 32
    kinds = rng.integers(0, 4, size=(rows, words))
    random_bits = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64)
    few = np.int64(1) << rng.integers(0, 31, size=(rows, words))
    mask = np.select([kinds == 0, kinds == 1, kinds == 2], [-1, 0, few], random_bits)
    return mask.astype(np.int32)


@pytest.mark.parametrize(("num_rows", "vocab"), [(1, 32), (5, 77), (40, 1000), (33, 4100)])
def test_forbidden_tokens_become_minus_inf_in_the_listed_rows_only(path, num_rows, vocab):
    rng = np.random.default_rng(num_rows * vocab)
    logits = torch.from_numpy(rng.standard_normal((num_rows, vocab), dtype=np.float32))
    rows = sorted(rng.choice(num_rows, size=max(1, num_rows // 2), replace=False).tolist())
    bitmask = random_bitmask(rng, len(rows), vocab)
    want = expected(logits, rows, bitmask)
    apply_token_bitmask_(logits, rows, bitmask)
    torch.testing.assert_close(logits, want, rtol=0, atol=0)


def test_rows_of_a_wider_tensor_keep_what_lies_past_the_vocab(path):
    """Logits as a view of the first 70 columns of 100: nothing past column 70 is written."""
    wide = torch.randn(3, 100)
    before = wide.clone()
    bitmask = np.zeros((2, 3), dtype=np.int32)  # nothing allowed
    apply_token_bitmask_(wide[:, :70], [0, 2], bitmask)
    assert torch.isneginf(wide[[0, 2], :70]).all()
    assert torch.equal(wide[1], before[1]) and torch.equal(wide[:, 70:], before[:, 70:])


def test_a_bitmask_of_the_wrong_shape_or_rows_out_of_range_are_refused(path):
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="bitmask"):
        apply_token_bitmask_(logits, [0], np.zeros((1, 3), dtype=np.int32))
    with pytest.raises(ValueError, match="bitmask"):
        apply_token_bitmask_(logits, [0], np.zeros((1, 2), dtype=np.int64))
    with pytest.raises(IndexError):
        apply_token_bitmask_(logits, [2], np.zeros((1, 2), dtype=np.int32))
    assert torch.equal(logits, torch.zeros(2, 64))


def test_bfloat16_logits_take_the_torch_path():
    logits = torch.zeros(1, 40, dtype=torch.bfloat16)
    apply_token_bitmask_(logits, [0], np.array([[1, 0]], dtype=np.int32))  # token 0 only
    assert logits[0, 0] == 0 and torch.isneginf(logits[0, 1:]).all()
