"""The native bf16 projection (switchboard_kernels/linear_bf16_cpu.c) against a float64 product."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from switchboard_kernels import native
from switchboard_kernels.linear import Linear
from switchboard_kernels.linear_native import (
    AMX_MIN_ROWS,
    Bf16PanelLinear,
    bf16_kernel_of,
    bf16_panels_use_amx,
    native_linear_bf16,
)

needs_kernel = pytest.mark.skipif(
    native_linear_bf16() is None,
    reason="no C compiler, or neither AVX-512 nor AVX2 with FMA: kernel not built",
)


def assert_within_one_rounding(got: torch.Tensor, want: torch.Tensor, scale: float) -> None:
    """fp32 sums rounded once to bf16: within one bf16 ulp of the float64 product, plus
    the fp32 summation's error (relative to the sum of |x w| over k)."""
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=scale * 1e-5)


def case(rows: int, out_features: int, in_features: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = (torch.randn(out_features, in_features, generator=gen) * 0.1).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    residual = torch.randn(rows, out_features, generator=gen).bfloat16()
    scale = float((x.double().abs() @ w.double().abs().T).max())
    return x, w, bias, residual, scale


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 17, 64])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 576), (40, 6), (1, 2), (100, 34)])
def test_matches_a_float64_product_with_bias_and_residual(rows, out_features, in_features):
    """Every row count of a tile (1-8 on AVX-512, 1-6 on AVX2; tiles plus a rest), partial
    last panels."""
    x, w, bias, residual, scale = case(rows, out_features, in_features, rows + out_features)
    want = x.double() @ w.double().T + bias.double() + residual.double()
    got = Bf16PanelLinear(w, bias)(x, residual)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert_within_one_rounding(got, want, scale)
    plain = Bf16PanelLinear(w)(x)
    assert_within_one_rounding(plain, x.double() @ w.double().T, scale)


needs_amx = pytest.mark.skipif(
    native_linear_bf16() is None or not bf16_panels_use_amx(),
    reason="the panels' build has no AMX tiles on this CPU (amx_bf16.h)",
)


@needs_amx
@pytest.mark.parametrize("rows", [AMX_MIN_ROWS, 15, 16, 17, 32, 33, 100])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 576), (49, 64), (33, 1536)])
def test_the_amx_tiles_match_a_float64_product(rows, out_features, in_features):
    """Rows padded to whole tiles (16), one or two tiles of rows a block, partial last
    panels; bias and a bf16 residual, fp32 out, and an fp32 residual added unrounded."""
    x, w, bias, residual, scale = case(rows, out_features, in_features, rows * out_features)
    product = x.double() @ w.double().T
    want = product + bias.double() + residual.double()
    assert_within_one_rounding(Bf16PanelLinear(w, bias)(x, residual), want, scale)
    logits = Bf16PanelLinear(w, fp32_out=True)(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), product, rtol=2**-22, atol=scale * 1e-5)
    stream = torch.randn(rows, out_features, dtype=torch.float64) * 1000 + 0.123
    summed = Bf16PanelLinear(w, bias).add_to_fp32(x, stream.float())
    torch.testing.assert_close(
        summed.double(), product + bias.double() + stream.float().double(),
        rtol=2**-22, atol=scale * 1e-5,
    )  # fmt: skip


@needs_amx
def test_on_the_tiles_a_row_sums_alike_whatever_rows_share_the_call():
    """From ``AMX_MIN_ROWS`` rows up every row takes the tiles' order, so a row's output does not
    depend on the others (a batch of 2 against one of 37); the vector tiles sum in another
    order, close but not always equal."""
    x, w, _, _, scale = case(37, 200, 576, 5)
    layer = Bf16PanelLinear(w, fp32_out=True)
    whole = layer(x)
    assert torch.equal(layer(x[:AMX_MIN_ROWS]), whole[:AMX_MIN_ROWS])
    assert torch.equal(layer(x[20:33]), whole[20:33])
    vector = Bf16PanelLinear(w, fp32_out=True, amx_rows=0)(x)
    torch.testing.assert_close(vector.double(), whole.double(), rtol=2**-20, atol=scale * 1e-5)


@needs_kernel
def test_the_panels_hold_the_weight_exactly():
    w = torch.randn(70, 12).bfloat16()
    assert torch.equal(Bf16PanelLinear(w).weight(), w)


@needs_kernel
def test_a_strided_residual_is_read_as_its_values():
    """A residual view that is not contiguous: the kernel reads a contiguous copy, which
    must stay alive while it runs."""
    x, w, bias, _, scale = case(6, 40, 64, 11)
    wide = torch.randn(6, 90, generator=torch.Generator().manual_seed(12)).bfloat16()
    residual = wide[:, 5:45]
    got = Bf16PanelLinear(w, bias)(x, residual)
    want = x.double() @ w.double().T + bias.double() + residual.double()
    assert_within_one_rounding(got, want, scale)


@needs_kernel
def test_rows_of_a_strided_view_and_no_rows():
    wide = torch.randn(5, 80).bfloat16()
    x, w = wide[:, 8:72], torch.randn(33, 64).bfloat16()
    layer = Bf16PanelLinear(w)
    assert_within_one_rounding(layer(x), x.double() @ w.double().T, 64.0)
    assert layer(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 33)


@needs_kernel
def test_wrong_inputs_are_refused_before_the_kernel_reads_them():
    layer = Bf16PanelLinear(torch.randn(8, 16).bfloat16())
    with pytest.raises(ValueError, match="bf16"):
        layer(torch.randn(2, 16))  # fp32 rows
    with pytest.raises(ValueError, match="16 features"):
        layer(torch.randn(2, 15).bfloat16())
    with pytest.raises(ValueError, match="residual"):
        layer(torch.randn(2, 16).bfloat16(), torch.randn(3, 8).bfloat16())
    with pytest.raises(ValueError, match="even"):
        Bf16PanelLinear(torch.randn(8, 15).bfloat16())


@needs_kernel
def test_linear_sends_bf16_weights_through_the_kernel():
    x, w, bias, residual, scale = case(4, 48, 64, 3)
    layer = Linear(w, bias)
    assert isinstance(layer.small, Bf16PanelLinear)
    assert_within_one_rounding(
        layer.add_to(x, residual), x.double() @ w.double().T + bias.double() + residual.double(),
        scale,
    )  # fmt: skip


def _cpu_flags() -> set[str]:
    info = Path("/proc/cpuinfo")
    text = info.read_text() if info.exists() else ""
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split()}


# The kernel's paths below the best this CPU has, each built here with the features above
# it turned off: (the flags, the feature this CPU must have for the test to mean anything).
OTHER_PATHS = {
    "avx512-fma": (("-mno-avx512bf16",), "avx512_bf16"),  # AVX-512 without BF16 (a Xeon)
    "avx2": (("-mno-avx512f",), "avx512f"),  # AVX2 and FMA only (Zen 2/3)
}


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17])
def test_an_fp32_residual_is_added_to_the_fp32_sums_unrounded(rows):
    """A bf16 model's fp32 residual stream: ``Linear.add_to`` keeps it fp32 (the residual's
    low bits survive, which a bf16 residual would round away)."""
    x, w, bias, _, scale = case(rows, 100, 34, rows + 5)
    stream = torch.randn(rows, 100, generator=torch.Generator().manual_seed(rows)) * 1000 + 0.123
    want = x.double() @ w.double().T + bias.double() + stream.double()
    got = Bf16PanelLinear(w, bias).add_to_fp32(x, stream)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2**-22, atol=scale * 1e-5)
    via_linear = Linear(w, bias).add_to(x, stream.clone())
    assert via_linear.dtype == torch.float32
    torch.testing.assert_close(via_linear.double(), want, rtol=2**-22, atol=scale * 1e-5)
    with pytest.raises(ValueError, match="fp32 residual"):
        Bf16PanelLinear(w, bias).add_to_fp32(x, stream[:, :50])


@needs_kernel
@pytest.mark.parametrize("path", OTHER_PATHS)
@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_the_paths_of_cpus_with_fewer_features(path, rows):
    """This CPU builds its best path; a build without the features above another path's
    runs that path here too, through the same panels (on a CPU of that kind, every other
    test here already runs it)."""
    flags, feature = OTHER_PATHS[path]
    if feature not in _cpu_flags():
        pytest.skip(f"without {feature} every other test here already runs this path")
    source = Path(native.__file__).with_name("linear_bf16_cpu.c")
    library = ctypes.CDLL(str(native.build(source, flags)))
    assert library.sb_linear_bf16_available()
    x, w, bias, residual, scale = case(rows, 100, 34, rows)
    layer = Bf16PanelLinear(w, bias, kernel=bf16_kernel_of(library))
    want = x.double() @ w.double().T + bias.double() + residual.double()
    assert_within_one_rounding(layer(x, residual), want, scale)
    # fp32 out (an output layer's logits): the same sums, unrounded
    wide = Bf16PanelLinear(w, bias, kernel=bf16_kernel_of(library), fp32_out=True)
    got = wide(x, residual)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=scale * 1e-5)
    assert torch.equal(got.bfloat16(), layer(x, residual))
    # an fp32 residual (a bf16 model's residual stream), read and returned unrounded
    stream = residual.float() + 1e-3
    summed = layer.add_to_fp32(x, stream)
    assert summed.dtype == torch.float32
    want = x.double() @ w.double().T + bias.double() + stream.double()
    torch.testing.assert_close(summed.double(), want, rtol=0, atol=scale * 1e-5)


@needs_kernel
@pytest.mark.parametrize("path", ["best", *OTHER_PATHS])
def test_fixed_order_gives_a_lone_row_the_bits_it_has_among_others(path):
    """``fixed_order`` (batch-invariant numerics): a row alone sums in the order it sums in
    a tile of many, on every path; tiles of any size, bias and residual."""
    if path == "best":
        kernel = None
    else:
        flags, feature = OTHER_PATHS[path]
        if feature not in _cpu_flags():
            pytest.skip(f"without {feature} the best path is this one")
        source = Path(native.__file__).with_name("linear_bf16_cpu.c")
        kernel = bf16_kernel_of(ctypes.CDLL(str(native.build(source, flags))))
    x, w, bias, residual, _ = case(17, 100, 576, 5)
    layer = Bf16PanelLinear(w, bias, kernel=kernel, fixed_order=True)
    whole = layer(x, residual)
    for rows in (1, 2, 7, 8, 9):
        for start in (0, 17 - rows):
            part = slice(start, start + rows)
            assert torch.equal(layer(x[part], residual[part]), whole[part])
