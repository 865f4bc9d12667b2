"""bench.logit_fidelity's pieces: the rounded head it compares against and its agreement count."""

from __future__ import annotations

import torch

from bench.logit_fidelity import RoundedHead, agreement


def test_rounded_head_rounds_fp32_sums_to_bf16_once():
    w = torch.randn(40, 16).bfloat16()
    x = torch.randn(3, 16).bfloat16()

    def head(rows: torch.Tensor) -> torch.Tensor:
        return rows.float() @ w.float().T

    y = RoundedHead(head)(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, head(x).bfloat16().float())


def test_agreement_counts_streams_first_tokens_and_common_prefixes():
    ours = [[1, 2, 3], [4, 5], [7]]
    ref = [[1, 2, 3], [4, 6], [8, 9]]
    assert agreement(ours, ref) == {
        "streams_equal": 1,
        "first_tokens_equal": 2,
        "mean_tokens_before_difference": (3 + 1 + 0) / 3,
        "streams": 3,
    }
