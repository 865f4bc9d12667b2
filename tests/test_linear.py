"""kernels.linear: oneDNN-packed projections against a float64 matmul of the same weights."""

from __future__ import annotations

import platform

import pytest
import torch

from kernels.linear import Linear, can_pack

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
    linear = Linear(weight, bias)
    assert (linear.packed is not None) == can_pack(weight)
    want = x.double() @ weight.double().T + bias.double()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(linear(x).double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(
        linear.add_to(x, residual).double(), want + residual.double(), atol=2 * tol, rtol=tol
    )


@pytest.mark.skipif(platform.machine() != "x86_64", reason="oneDNN packing checked on x86")
def test_fp32_weights_are_packed_on_this_cpu():
    """oneDNN packs fp32 on every x86 CPU torch runs on; bf16 only where it is native."""
    assert Linear(torch.randn(8, 8)).packed is not None


def dequantized_int4(weight: torch.Tensor, group: int) -> torch.Tensor:
    """The 4-bit weight as specified: per group of input features, 16 levels from its
    minimum to its maximum, each weight rounded to the nearest level, q in 0..15; stored
    as (q - 8) x scale + zero with scale and zero in the weight's dtype (fp64 here)."""
    out_features, in_features = weight.shape
    # In fp32, so that weights on bf16's grid that sit on a tie between levels round the
    # same way as in the implementation (fp64 would break some ties the other way).
    w = weight.float().view(out_features, in_features // group, group)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    step = (high - low) / 15
    q = torch.round((w - low) / step).double()
    scale, zero = (t.to(weight.dtype).double() for t in (step, low + 8 * step))
    return ((q - 8) * scale + zero).view(out_features, in_features)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 4])
def test_small_batches_multiply_by_the_4bit_weight(dtype, tokens):
    from kernels.linear import INT4_GROUP

    gen = torch.Generator().manual_seed(tokens)
    weight = (torch.randn(96, 128, generator=gen) / 128**0.5).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(tokens, 128, generator=gen).to(dtype)
    residual = torch.randn(tokens, 96, generator=gen).to(dtype)
    linear = Linear(weight, bias, int4_rows=True)
    assert linear.int4 is not None
    deq = dequantized_int4(weight, INT4_GROUP)
    # Rounding to 16 levels moves a weight by at most half a level (and bf16's scale and
    # zero by their own rounding).
    w = weight.double().view(96, -1, INT4_GROUP)
    half_level = ((w.amax(-1) - w.amin(-1)) / 30).repeat_interleave(INT4_GROUP, dim=1)
    slack = 1e-6 if dtype == torch.float32 else 0.02 * weight.double().abs().max()
    assert ((deq - weight.double()).abs() <= half_level + slack).all()
    want = x.double() @ deq.T + bias.double()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(linear(x).double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(
        linear.add_to(x, residual).double(), want + residual.double(), atol=2 * tol, rtol=tol
    )


def test_larger_batches_and_unfit_shapes_keep_the_full_weight():
    """Past INT4_MAX_ROWS rows the 4-bit copy is no faster, so the weight itself serves;
    input features that are not a whole number of groups get no 4-bit copy at all."""
    from kernels.linear import INT4_MAX_ROWS

    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(32, 64, generator=gen)
    x = torch.randn(INT4_MAX_ROWS + 1, 64, generator=gen)
    exact = x.double() @ weight.double().T
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(
        Linear(weight, int4_rows=True)(x).double(), exact, atol=tol, rtol=tol
    )
    unfit = Linear(torch.randn(32, 80), int4_rows=True)
    assert unfit.int4 is None


def test_a_4bit_copy_reads_a_quarter_of_the_bytes():
    weight = torch.randn(256, 128, dtype=torch.bfloat16)
    full, quantized = Linear(weight).decode_bytes, Linear(weight, int4_rows=True).decode_bytes
    assert full == 256 * 128 * 2
    # 4 bits a weight, plus a bf16 scale and zero per group of 64
    assert quantized == 256 * 128 // 2 + 256 * 2 * 2 * 2
