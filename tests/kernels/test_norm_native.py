"""The native bf16 and fp32 RMSNorm (switchboard_kernels/norm_cpu.c) against a float64 RMSNorm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from switchboard_kernels.norm_native import native_norm, rms_norm, torch_rms_norm

KERNEL = native_norm()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler: kernel not built")


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def assert_within_one_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """An fp32 result rounded once to bf16: within one bf16 ulp (2^-8 relative)."""
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (7, 40), (64, 576), (1024, 576), (3, 8)])
def test_kernel_matches_a_float64_rmsnorm(rows, dim):
    """Rows on the calling thread and, from 65,536 elements, shared by the threads."""
    gen = torch.Generator().manual_seed(rows + dim)
    x = (torch.randn(rows, dim, generator=gen) * 3).bfloat16()
    weight = torch.randn(dim, generator=gen).bfloat16()
    got = KERNEL(x, weight, 1e-5)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert_within_one_rounding(got, reference(x, weight, 1e-5))


@needs_kernel
def test_rows_may_be_a_strided_view():
    wide = torch.randn(5, 100).bfloat16()
    x, weight = wide[:, 10:74], torch.rand(64).bfloat16()
    assert_within_one_rounding(KERNEL(x, weight, 1e-6), reference(x, weight, 1e-6))


@needs_kernel
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (7, 40), (1024, 576)])
def test_fp32_rows_match_a_float64_rmsnorm(rows, dim):
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, dim, generator=gen) * 3, torch.randn(dim, generator=gen)
    got = KERNEL(x, weight, 1e-5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(x, weight, 1e-5), rtol=1e-6, atol=1e-6)
    assert torch.equal(rms_norm(x, weight, 1e-5), got)  # the engine's entry takes the kernel


@needs_kernel
def test_mismatched_inputs_are_refused():
    x = torch.randn(2, 16).bfloat16()
    bad = [
        (x, torch.ones(16)),
        (x, torch.ones(8).bfloat16()),
        (x[None], x[0]),
        (x.half(), torch.ones(16).half()),
    ]
    for bad_x, bad_weight in bad:
        with pytest.raises(ValueError, match="native rms_norm"):
            KERNEL(bad_x, bad_weight, 1e-5)


@needs_kernel
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (7, 40), (1024, 576)])
def test_fp32_rows_with_a_bf16_weight_come_out_bf16_rounded_once(rows, dim):
    """A bf16 model's norm over its fp32 residual stream: the rows read unrounded."""
    gen = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, dim, generator=gen) * 3
    x[:, 0] = 24_900.0  # a massive activation, which bf16 would space 128 apart
    weight = torch.randn(dim, generator=gen).bfloat16()
    got = KERNEL(x, weight, 1e-5)
    assert got.dtype == torch.bfloat16
    assert_within_one_rounding(got, reference(x, weight, 1e-5))
    assert torch.equal(rms_norm(x, weight, 1e-5), got)  # the engine's entry takes the kernel


def test_fp32_rows_with_a_bf16_weight_take_torchs_op_alike():
    x, weight = torch.randn(9, 48) * 3, torch.randn(48).bfloat16()
    got = torch_rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.bfloat16
    assert_within_one_rounding(got, reference(x, weight, 1e-5))


def test_other_dtypes_take_torchs_op():
    x, weight = torch.randn(9, 48).half(), torch.randn(48).half()
    assert torch.equal(rms_norm(x, weight, 1e-5), F.rms_norm(x, (48,), weight, 1e-5))
