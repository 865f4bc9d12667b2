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
