"""switchboard_kernels.linear: packed projections (oneDNN's, or panels for our native kernel) and
the draft's quantized copies, against a float64 matmul of the same (or the dequantized) weights."""

from __future__ import annotations

import platform

import pytest
import torch

from q4_levels import activation_levels, weight_levels
from switchboard_kernels.linear import (
    INT4_MAX_ROWS,
    Q4_MAX_ROWS,
    Int4Weight,
    Linear,
    OnednnLinear,
    TorchLinear,
    UpcastLinear,
)
from switchboard_kernels.linear_choice import (
    ONEDNN,
    PANELS,
    TORCH,
    UPCAST,
    LinearPlan,
    available_kernels,
    invariant_plan,
)
from switchboard_kernels.linear_native import PANEL, Bf16PanelLinear, PanelLinear, native_linear
from switchboard_kernels.q4_native import Q4Linear, native_q4

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_projection_and_fused_residual_match_float64(dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    weight = (torch.randn(96, 80, generator=gen) / 80**0.5).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(tokens, 80, generator=gen).to(dtype)
    residual = torch.randn(tokens, 96, generator=gen).to(dtype)
    want = x.double() @ weight.double().T + bias.double()
    tol = TOLERANCE[dtype]
    for kernel in [*available_kernels(dtype), TORCH]:
        linear = Linear(weight, bias, plan=LinearPlan(kernel, kernel))
        torch.testing.assert_close(linear(x).double(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(
            linear.add_to(x, residual).double(), want + residual.double(), atol=2 * tol, rtol=tol
        )


@pytest.mark.skipif(platform.machine() != "x86_64", reason="packing checked on x86")
def test_fp32_weights_follow_the_fixed_rule_without_a_plan():
    """fp32 weights go into panels for the native kernel on an AVX2-only CPU, else into
    oneDNN's layout (which takes fp32 on every x86 CPU torch runs on); one copy."""
    linear = Linear(torch.randn(8, 8))
    avx2_only = torch.backends.cpu.get_cpu_capability() == "AVX2"
    if avx2_only and native_linear() is not None:
        assert isinstance(linear.small, PanelLinear)
    else:
        assert isinstance(linear.small, OnednnLinear)
    assert linear.kernels == (linear.small,)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_plan_of_two_kernels_sends_rows_by_count(dtype):
    """A plan's small-row kernel takes up to split_rows rows, its large-row kernel more; both
    multiply exactly (each within its dtype's rounding of the float64 product)."""
    kernels = available_kernels(dtype)
    if len(kernels) < 2:
        pytest.skip(f"one kernel for {dtype} here: {kernels}")
    gen = torch.Generator().manual_seed(9)
    weight = (torch.randn(64, 48, generator=gen) / 48**0.5).to(dtype)
    linear = Linear(weight, plan=LinearPlan(kernels[0], kernels[1], split_rows=4))
    kinds = {
        PANELS: (PanelLinear, Bf16PanelLinear),
        ONEDNN: (OnednnLinear,),
        UPCAST: (UpcastLinear,),
    }
    assert isinstance(linear.small, kinds[kernels[0]])
    assert isinstance(linear.large, kinds[kernels[1]])
    calls = []
    for name in ("small", "large"):
        kernel = getattr(linear, name)
        setattr(linear, name, lambda x, r=None, k=kernel, n=name: calls.append(n) or k(x, r))
    for rows in (1, 4, 5, 33):
        x = torch.randn(rows, 48, generator=gen).to(dtype)
        want = x.double() @ weight.double().T
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(linear(x).double(), want, atol=tol, rtol=tol)
    assert calls == ["small", "small", "large", "large"]


def test_a_kernel_that_cannot_hold_the_weight_falls_back():
    """bf16 panels need an even number of input features: an odd one goes to oneDNN (or
    F.linear), still exact."""
    weight = torch.randn(16, 15).bfloat16()
    linear = Linear(weight, plan=LinearPlan(PANELS, PANELS))
    assert isinstance(linear.small, (OnednnLinear, TorchLinear))
    x = torch.randn(3, 15).bfloat16()
    torch.testing.assert_close(
        linear(x).double(), x.double() @ weight.double().T, atol=2e-2, rtol=2e-2
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_invariant_plan_gives_a_row_the_same_bits_in_any_batch(dtype):
    """Batch invariance: a row's product, bias and residual bit for bit the same alone as
    among any number of other rows (lone rows too, which otherwise sum in two chains)."""
    plan = invariant_plan(dtype)
    if plan is None:
        pytest.skip(f"no native panels for {dtype} here")
    gen = torch.Generator().manual_seed(4)
    weight = (torch.randn(70, 96, generator=gen) / 96**0.5).to(dtype)
    bias = torch.randn(70, generator=gen).to(dtype)
    linear = Linear(weight, bias, plan=plan)
    assert all(isinstance(k, (PanelLinear, Bf16PanelLinear)) for k in linear.kernels)
    x = torch.randn(19, 96, generator=gen).to(dtype)
    residual = torch.randn(19, 70, generator=gen).to(dtype)
    whole, fused = linear(x), linear.add_to(x, residual)
    for rows in (1, 2, 5, 8, 9, 13):
        for start in (0, 19 - rows, 3):
            part = slice(start, start + rows)
            assert torch.equal(linear(x[part]), whole[part])
            assert torch.equal(linear.add_to(x[part], residual[part]), fused[part])


def test_the_invariant_plan_takes_no_other_kernel():
    """A weight the bf16 panels cannot hold (odd input features) is refused, not sent to
    oneDNN, whose summation order depends on the rows."""
    plan = invariant_plan(torch.bfloat16)
    if plan is None:
        pytest.skip("no native bf16 panels here")
    with pytest.raises(ValueError, match="batch-invariant"):
        Linear(torch.randn(16, 15).bfloat16(), plan=plan)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 4, 16])
def test_small_batches_multiply_by_the_4bit_weight(dtype, tokens):
    """Through the native kernel where it builds (the rows rounded to int8 as well), else
    through torch's int4 kernel (the rows as they are): the same 4-bit levels either way."""
    gen = torch.Generator().manual_seed(tokens)
    weight = (torch.randn(96, 128, generator=gen) / 128**0.5).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(tokens, 128, generator=gen).to(dtype)
    residual = torch.randn(tokens, 96, generator=gen).to(dtype)
    linear = Linear(weight, bias, quantization="int4")
    native = native_q4() is not None
    assert isinstance(linear.int4, Q4Linear if native else Int4Weight)
    if tokens > linear.int4_rows:
        pytest.skip("past the 4-bit rows of torch's kernel")
    rows = activation_levels(x) if native else x.double()
    want = rows @ weight_levels(weight).T + bias.double()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(linear(x).double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(
        linear.add_to(x, residual).double(), want + residual.double(), atol=2 * tol, rtol=tol
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torchs_int4_kernel_multiplies_by_the_same_levels(dtype):
    """The fallback where no C compiler builds the native kernel."""
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(48, 192, generator=gen) / 192**0.5).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(3, 192, generator=gen).to(dtype)
    residual = torch.randn(3, 48, generator=gen).to(dtype)
    int4 = Int4Weight(weight, bias)
    want = x.double() @ weight_levels(weight).T + bias.double()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(int4(x).double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(
        int4(x, residual).double(), want + residual.double(), atol=2 * tol, rtol=tol
    )


def test_larger_batches_and_unfit_shapes_keep_the_full_weight():
    """Past the 4-bit copy's rows it is no faster, so the weight itself serves; input
    features that are not a whole number of groups get no 4-bit copy at all."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(32, 64, generator=gen)
    linear = Linear(weight, quantization="int4")
    assert linear.int4_rows == (Q4_MAX_ROWS if native_q4() is not None else INT4_MAX_ROWS)
    x = torch.randn(linear.int4_rows + 1, 64, generator=gen)
    exact = x.double() @ weight.double().T
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(linear(x).double(), exact, atol=tol, rtol=tol)
    unfit = Linear(torch.randn(32, 80), quantization="int4")
    assert unfit.int4 is None


def test_a_4bit_copy_reads_a_quarter_of_the_bytes():
    weight = torch.randn(256, 128, dtype=torch.bfloat16)
    full, quantized = Linear(weight).decode_bytes, Linear(weight, quantization="int4").decode_bytes
    assert full == 256 * 128 * 2
    # 4 bits a weight, plus a 16-bit step and minimum per group of 64
    assert quantized == 256 * 128 // 2 + 256 * 2 * 2 * 2


needs_native = pytest.mark.skipif(native_linear() is None, reason="no C compiler here")


def float64_linear(x, weight, bias=None, residual=None):
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return y if residual is None else y + residual.double()


@needs_native
@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    # rows around the kernel's 6-row tiles; a partial last panel; one input feature; a
    # wide input (the down projection's shape class); a single row (its own loop, two input
    # features a step) with an odd count of features and with one
    [
        (1, 16, 8),
        (5, 37, 13),
        (6, 48, 1),
        (7, 33, 64),
        (13, 96, 80),
        (40, 17, 300),
        (1, 37, 13),
        (1, 20, 1),
    ],
)
def test_the_native_kernel_matches_float64(rows, out_features, in_features, int8):
    gen = torch.Generator().manual_seed(rows * out_features)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    bias = torch.randn(out_features, generator=gen)
    # rows of a wider buffer (copied to contiguous rows for the kernel)
    x = torch.randn(rows, in_features + 3, generator=gen)[:, :in_features]
    residual = torch.randn(rows, out_features, generator=gen)
    for b in (None, bias):
        linear = PanelLinear(weight, b, int8=int8)
        assert linear.panels.shape == (-(-out_features // PANEL), in_features, PANEL)
        w = linear.dequantized().double()  # the weight the copy multiplies by
        if not int8:
            assert torch.equal(w, weight.double())
        for r in (None, residual):
            got = linear(x, r).double()
            torch.testing.assert_close(got, float64_linear(x, w, b, r), atol=1e-5, rtol=1e-5)


@needs_native
def test_int8_weights_round_each_to_the_nearest_of_255_levels_of_its_output():
    """Symmetric per output feature: the largest magnitude is exact and every weight moves
    by at most half a level; an all-zero output stays zero (no division by zero)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(20, 50, generator=gen)
    weight[3] = 0.0
    linear = PanelLinear(weight, int8=True)
    w = linear.dequantized()
    level = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((w - weight).abs() <= level / 2 + 1e-7).all()
    assert torch.equal(w[3], weight[3]) and torch.isfinite(w).all()
    biggest = weight.abs().argmax(dim=1)
    rows = torch.arange(20)
    torch.testing.assert_close(w[rows, biggest], weight[rows, biggest], rtol=1e-6, atol=0)
    assert linear.nbytes == 20 * 50 + 20 * 4  # a byte a weight, a scale an output


@needs_native
def test_int8_linear_serves_every_batch_and_reads_a_quarter_of_the_bytes():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 96, generator=gen)
    linear = Linear(weight, quantization="int8")
    w = linear.small.dequantized()
    for rows in (1, 4, 33):
        x = torch.randn(rows, 96, generator=gen)
        want = float64_linear(x, w)
        torch.testing.assert_close(linear(x).double(), want, atol=1e-5, rtol=1e-5)
    assert linear.decode_bytes == 64 * 96 + 64 * 4
    assert Linear(weight).decode_bytes == 64 * 96 * 4


def test_bad_quantizations_are_refused():
    with pytest.raises(ValueError, match="quantization must be one of"):
        Linear(torch.randn(4, 4), quantization="int2")
    with pytest.raises(ValueError, match="int8 weights need fp32"):
        Linear(torch.randn(4, 4, dtype=torch.bfloat16), quantization="int8")


@needs_native
def test_the_native_kernel_refuses_what_it_cannot_read():
    linear = PanelLinear(torch.randn(8, 4))
    with pytest.raises(ValueError, match="fp32 CPU rows of 4 features"):
        linear(torch.randn(2, 5))
    with pytest.raises(ValueError, match="fp32 CPU rows"):
        linear(torch.randn(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="fp32 CPU rows"):
        linear(torch.randn(4))
    with pytest.raises(ValueError, match="residual must be fp32"):
        linear(torch.randn(2, 4), torch.randn(3, 8))
    with pytest.raises(ValueError, match="bias must be fp32"):
        PanelLinear(torch.randn(8, 4), torch.randn(7))
