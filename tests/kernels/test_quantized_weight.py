"""The quantized-weight format every quantized base reaches the kernels in."""

import pytest
import torch

from switchboard_kernels.linear import Linear
from switchboard_kernels.quantized_weight import QuantizedWeight, cat_rows, quantize


def make_weight(out_features=24, in_features=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_round_to_nearest_is_within_half_a_step(bits, group_size, symmetric):
    w = make_weight()
    q = quantize(w, bits=bits, group_size=group_size, symmetric=symmetric)
    error = (q.dequantize() - w).abs().view(24, -1, group_size)
    assert (error <= q.scales[..., None] / 2 + 1e-6).all()
    assert int(q.levels.max()) <= 2**bits - 1


def test_act_order_columns_land_on_their_features():
    w = make_weight()
    order = torch.randperm(128, generator=torch.Generator().manual_seed(1))
    stored = quantize(w[:, order], bits=4, group_size=32, symmetric=False)
    q = QuantizedWeight(stored.levels, stored.scales, stored.zeros, 4, 32, order)
    assert torch.equal(q.dequantize(), stored.dequantize()[:, torch.argsort(order)])


def test_shards_and_fusion_keep_the_weight():
    a, b = make_weight(seed=2), make_weight(16, seed=3)
    qa, qb = (quantize(x, bits=4, group_size=32, symmetric=False) for x in (a, b))
    fused = cat_rows([qa, qb])
    assert torch.equal(fused.dequantize(), torch.cat([qa.dequantize(), qb.dequantize()]))
    assert torch.equal(fused.rows(24, 40).dequantize(), qb.dequantize())
    assert torch.equal(fused.columns(32, 96).dequantize(), fused.dequantize()[:, 32:96])
    with pytest.raises(ValueError, match="split a group"):
        fused.columns(16, 96)
    with pytest.raises(ValueError, match="alike"):
        cat_rows([qa, quantize(b, bits=8, group_size=32, symmetric=True)])


def test_malformed_parts_are_refused():
    q = quantize(make_weight(), bits=4, group_size=32, symmetric=True)
    with pytest.raises(ValueError, match="scales"):
        QuantizedWeight(q.levels, q.scales.half(), q.zeros, 4, 32)
    with pytest.raises(ValueError, match="3-bit"):
        QuantizedWeight(q.levels, q.scales, q.zeros, 3, 32)
    with pytest.raises(ValueError, match="does not divide"):
        QuantizedWeight(q.levels, q.scales, q.zeros, 4, 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_over_a_quantized_weight_multiplies_by_its_dequantized_weight(dtype):
    q = quantize(make_weight(), bits=4, group_size=32, symmetric=False)
    x = torch.randn(3, 128).to(dtype)
    expected = x.float() @ q.dequantize().T
    # the native kernel sums in another order than the reference (fp32 either way; outputs
    # up to ~25 here, so 3e-5 is about one part in a million)
    assert torch.allclose(
        Linear(q)(x).float(), expected, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=3e-5
    )
    assert torch.allclose(Linear(q, fp32_out=True)(x), expected, rtol=1e-5, atol=3e-5)


def test_a_float_zero_spans_each_group_from_its_minimum_to_its_maximum():
    """``integer_zero=False``: the group's minimum and maximum are levels 0 and 15, every weight
    within half a step, a constant group exact; weights on such a grid already come back
    exactly (a checkpoint dequantized from Q4_1 blocks of the same size)."""
    w = make_weight().abs() + 0.5  # groups that do not hold 0
    w[3, :32] = 0.25
    q = quantize(w, bits=4, group_size=32, symmetric=False, integer_zero=False)
    deq = q.dequantize()
    g = w.view(24, -1, 32)
    levels = q.levels.view(24, -1, 32)
    assert (levels.amin(-1) == 0).all() and (levels[g.amax(-1) > g.amin(-1)].amax(-1) == 15).all()
    assert ((deq - w).abs().view(24, -1, 32) <= q.scales[..., None] / 2 + 1e-6).all()
    assert torch.equal(deq[3, :32], w[3, :32])
    grid = q.dequantize()
    again = quantize(grid, bits=4, group_size=32, symmetric=False, integer_zero=False)
    torch.testing.assert_close(again.dequantize(), grid, atol=1e-6, rtol=0)
    # the integer zero stretches each such group's range down to 0: coarser steps
    spread = g.amax(-1) > g.amin(-1)
    stretched = quantize(w, bits=4, group_size=32, symmetric=False).scales
    assert (stretched[spread] > q.scales[spread]).all()


def fp16_values(t: torch.Tensor) -> bool:
    return torch.equal(t.half().float(), t)


@pytest.mark.parametrize("symmetric,integer_zero", [(True, True), (False, True), (False, False)])
def test_fp16_params_round_on_their_own_grid(symmetric, integer_zero):
    """``fp16_params`` (the on-load quantizer's): scales and zeros are fp16 values (the native
    kernel then holds them in 2 bytes) and every weight is still within half a step of its
    level, the levels rounded on the rounded grid."""
    w = make_weight() * 0.02
    q = quantize(
        w, bits=4, group_size=32, symmetric=symmetric, integer_zero=integer_zero, fp16_params=True
    )
    assert fp16_values(q.scales) and fp16_values(q.zeros)
    error = (q.dequantize() - w).abs().view(24, -1, 32)
    assert (error <= q.scales[..., None] / 2 + 1e-7).all()


@pytest.mark.parametrize(
    "weight",
    [
        make_weight() * 1e6,  # scales past fp16's largest value
        make_weight() * 1e-7,  # scales below its smallest normal: fewer digits
        make_weight() * 1e-3 + 100.0,  # float zeros near -100 / 1e-3: fp16 would move them
    ],
    ids=["huge", "tiny", "far-zero"],
)
def test_fp16_params_fall_back_to_fp32_where_they_would_lose_digits(weight):
    q = quantize(
        weight, bits=4, group_size=32, symmetric=False, integer_zero=False, fp16_params=True
    )
    exact = quantize(weight, bits=4, group_size=32, symmetric=False, integer_zero=False)
    assert torch.equal(q.levels, exact.levels) and torch.equal(q.scales, exact.scales)
    assert not (fp16_values(q.scales) and fp16_values(q.zeros))
