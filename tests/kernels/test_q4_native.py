"""switchboard_kernels/q4_cpu.c: 4-bit weights times int8-rounded activations, every compiled loop
(AVX-512 VNNI, AVX2, portable) against float64 products of the levels as specified here."""

from __future__ import annotations

import pytest
import torch

from q4_levels import activation_levels, weight_levels
from switchboard_kernels.q4_native import GROUP, Q4Linear, Q4Path, dequantize_weight, native_q4

pytestmark = pytest.mark.skipif(native_q4() is None, reason="no C compiler here")

PATHS = {Q4Path.BEST: "best", Q4Path.AVX2: "avx2", Q4Path.PORTABLE: "portable"}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def compiled_paths() -> list[int]:
    return native_q4().paths if native_q4() is not None else []


@pytest.mark.parametrize("path", [p for p in PATHS if p in compiled_paths()], ids=PATHS.get)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    # a single row; row tiles of 4 and what is left of them; a partial last panel; one
    # group of input features; the draft's down projection's width class
    [(1, 16, 64), (3, 33, 192), (4, 96, 128), (5, 50, 64), (9, 17, 320), (2, 48, 1536)],
)
def test_every_loop_matches_float64(path, dtype, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    bias = torch.randn(out_features, generator=gen)
    x = (3 * torch.randn(rows, in_features, generator=gen)).to(dtype)
    residual = torch.randn(rows, out_features, generator=gen).to(dtype)
    w = weight_levels(weight)
    xq = activation_levels(x)
    tol = TOLERANCE[dtype]
    for b in (None, bias):
        linear = Q4Linear(weight, b)
        for r in (None, residual):
            want = xq @ w.T
            if b is not None:
                want = want + b.double()
            if r is not None:
                want = want + r.double()
            got = linear(x, r, path=path)
            assert got.dtype == dtype and got.shape == (rows, out_features)
            torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_levels_stay_within_half_a_step_of_each_weight():
    """Rounding to 16 levels moves a weight by at most half a step (and fp16's rounding of
    the minimum and step by their own share); a constant group is exact."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 128, generator=gen)
    weight[5, :GROUP] = 0.25
    linear = Q4Linear(weight)
    from switchboard_kernels.q4_native import quantize_weight

    deq = dequantize_weight(*quantize_weight(weight)).double()
    torch.testing.assert_close(deq, weight_levels(weight), atol=0, rtol=0)
    g = weight.double().view(24, -1, GROUP)
    half_step = ((g.amax(-1) - g.amin(-1)) / 30).repeat_interleave(GROUP, dim=1)
    assert ((deq - weight.double()).abs() <= half_step + 2e-3).all()
    assert torch.equal(deq[5, :GROUP], weight[5, :GROUP].double())
    # two panels (24 outputs padded to 32) by two groups, each block 512 bytes of levels
    # (4 bits a weight) and 64 of fp16 steps and minimums
    assert linear.nbytes == 2 * 2 * 576


def test_a_zero_row_and_a_spike_are_rounded_per_group():
    """A row of zeros gives the bias; a group's large value sets that group's levels only."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(16, 128, generator=gen)
    bias = torch.randn(16, generator=gen)
    x = torch.zeros(2, 128)
    x[1] = torch.randn(128, generator=gen) * 0.01
    x[1, 3] = 50.0  # the first group's step is 50 / 127: its small values round to 0
    got = Q4Linear(weight, bias)(x).double()
    torch.testing.assert_close(got[0], bias.double(), atol=1e-6, rtol=0)
    want = activation_levels(x) @ weight_levels(weight).T + bias.double()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (activation_levels(x)[1, 64:] != 0).any()  # the second group keeps its detail


def test_bad_inputs_are_refused():
    linear = Q4Linear(torch.randn(8, 64))
    with pytest.raises(ValueError, match="rows of 64 features"):
        linear(torch.randn(2, 65))
    with pytest.raises(ValueError, match="bf16 or fp32"):
        linear(torch.randn(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="residual must be"):
        linear(torch.randn(2, 64), torch.randn(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiples of 64"):
        Q4Linear(torch.randn(8, 80))
    with pytest.raises(ValueError, match="fp16's range"):
        Q4Linear(torch.full((8, 64), 1e6))
