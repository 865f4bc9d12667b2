"""Multi-LoRA kernel-test inputs and the independent oracle, shared by the Triton, CPU and
native kernel tests: adapter mixes after Punica's test set (distinct, uniform, zipf,
identical, skewed) plus rows without an adapter, PEFT-shaped stacks, and a float64
per-token loop the references are checked against."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IN_FEATURES = 80  # > one SGMV BLOCK_K (64): the shrink loop runs twice
OUT_FEATURES = 72  # > one SGMV BLOCK_N (64): two output blocks
NUM_SLOTS = 4
PATTERNS = ["distinct", "uniform", "zipf", "identical", "skewed", "with_base"]
RANKS = [(1, 1), (1, 16), (8, 16), (16, 16), (64, 64)]  # (adapter rank, stack max_rank)
# Against an fp32-accumulating reference.
TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 1e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}


@dataclass
class Batch:
    seq_lens: list[int]  # tokens per sequence (0 = empty segment)
    seq_slots: list[int]  # adapter slot per sequence, -1 = none

    @property
    def token_slots(self) -> torch.Tensor:  # [T] int64
        return torch.repeat_interleave(torch.tensor(self.seq_slots), torch.tensor(self.seq_lens))

    @property
    def seg_starts(self) -> torch.Tensor:  # [num_seqs + 1] int64
        return torch.tensor([0, *np.cumsum(self.seq_lens).tolist()], dtype=torch.int64)

    @property
    def seg_slots(self) -> torch.Tensor:  # [num_seqs] int64
        return torch.tensor(self.seq_slots, dtype=torch.int64)

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)


def make_batch(pattern: str, *, num_tokens: int = 17, decode: bool, seed: int = 0) -> Batch:
    """Decode: one token per sequence. Prefill: a few sequences of random lengths."""
    rng = np.random.default_rng(seed)
    if decode:
        lens = [1] * num_tokens
    elif pattern == "skewed":  # one long segment beside single tokens
        lens = [num_tokens - 3, 1, 1, 1][-num_tokens:] if num_tokens > 3 else [num_tokens]
    else:
        cuts = np.sort(
            rng.choice(np.arange(1, num_tokens), size=min(4, num_tokens - 1), replace=False)
        )
        lens = np.diff([0, *cuts.tolist(), num_tokens]).tolist()
    n = len(lens)
    zipf = 1.0 / np.arange(1, NUM_SLOTS + 1) ** 1.5
    slots = {
        "distinct": [i % NUM_SLOTS for i in range(n)],
        "uniform": rng.integers(0, NUM_SLOTS, n).tolist(),
        "zipf": rng.choice(NUM_SLOTS, size=n, p=zipf / zipf.sum()).tolist(),
        "identical": [NUM_SLOTS - 1] * n,  # not slot 0: a wrong slot stride shows
        "skewed": [1] + [2] * (n - 1),
        "with_base": rng.integers(-1, NUM_SLOTS, n).tolist(),
    }[pattern]
    return Batch(lens, slots)


def make_stacks(rank: int, max_rank: int, *, dtype=torch.float32, seed: int = 0):
    """PEFT-shaped adapters zero-padded to max_rank; alpha/r differs per slot."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.zeros(NUM_SLOTS, max_rank, IN_FEATURES)
    b = torch.zeros(NUM_SLOTS, OUT_FEATURES, max_rank)
    a[:, :rank] = torch.randn(NUM_SLOTS, rank, IN_FEATURES, generator=gen) / IN_FEATURES**0.5
    b[:, :, :rank] = torch.randn(NUM_SLOTS, OUT_FEATURES, rank, generator=gen) / rank**0.5
    scales = torch.tensor([1.0, 2.0, 0.5, 4.0]) / rank
    return a.to(dtype), b.to(dtype), scales


def make_inputs(num_tokens: int, *, dtype=torch.float32, extra_cols: int = 0, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, IN_FEATURES, generator=gen).to(dtype)
    y = torch.randn(num_tokens, OUT_FEATURES + extra_cols, generator=gen).to(dtype)
    return x, y


def loop_lora(y, x, a, b, scales, token_slots, *, rank: int, out_offset: int = 0):
    """The independent oracle: a float64 Python loop over tokens, x[t] @ A.T @ B.T * scale."""
    out = y.double().clone()
    shrunk = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            a_s, b_s = a[s, :rank].double(), b[s, :, :rank].double()
            shrunk[t, :rank] = x[t].double() @ a_s.T
            delta = x[t].double() @ a_s.T @ b_s.T * float(scales[s])
            out[t, out_offset : out_offset + b.shape[1]] += delta
    return shrunk, out


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual.double(), expected.double(), **TOLERANCE[dtype])


def assert_untouched(y_after, y_before, token_slots, out_offset: int):
    """Rows without an adapter, and columns outside the projection's slice, keep their bits."""
    base_rows = token_slots < 0
    assert torch.equal(y_after[base_rows], y_before[base_rows])
    cols = torch.ones(y_after.shape[1], dtype=torch.bool)
    cols[out_offset : out_offset + OUT_FEATURES] = False
    assert torch.equal(y_after[:, cols], y_before[:, cols])
