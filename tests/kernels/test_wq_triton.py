"""The Triton dequantize-GEMM (``switchboard_kernels/wq_triton.py``) against the torch reference
(``QuantizedReference``): odd shapes, 1..N rows, 4 and 8 bits, groups and per channel, symmetric
and not, act-order, bias, residual, fp32 out. On a CUDA device if there is one, else in Triton's
CPU interpreter (the flag set before triton is imported; tiny shapes)."""

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402

import switchboard_kernels.wq_triton as tri  # noqa: E402
from switchboard_kernels.quantized_linear import QuantizedReference  # noqa: E402
from switchboard_kernels.quantized_weight import QuantizedWeight, quantize  # noqa: E402

TRITON_HERE = CUDA or (
    type(tl.zeros).__name__ == "InterpretedFunction"
    and type(tri._wq_kernel).__name__ == "InterpretedFunction"
)
pytestmark = pytest.mark.skipif(
    not TRITON_HERE, reason="triton was imported without TRITON_INTERPRET=1 before this module"
)
DEVICE = "cuda" if CUDA else "cpu"


def on(q: QuantizedWeight) -> QuantizedWeight:
    order = None if q.input_order is None else q.input_order.to(DEVICE)
    return QuantizedWeight(
        q.levels.to(DEVICE), q.scales.to(DEVICE), q.zeros.to(DEVICE), q.bits, q.group_size, order
    )


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "group", "symmetric", "act_order"),
    [
        (1, 16, 64, 32, False, False),
        (3, 40, 96, None, True, False),  # per channel; a partial output block
        (17, 24, 128, 64, False, True),  # two row blocks; act-order
        (5, 33, 160, 32, True, False),  # K not a multiple of BLOCK_K
    ],
)
def test_matches_the_reference(bits, rows, out_features, in_features, group, symmetric, act_order):
    gen = torch.Generator().manual_seed(rows + out_features + bits)
    w = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    q = quantize(w, bits=bits, group_size=group or in_features, symmetric=symmetric)
    if act_order:
        order = torch.randperm(in_features, generator=gen)
        q = QuantizedWeight(q.levels, q.scales, q.zeros, bits, q.group_size, order)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    res = torch.randn(rows, out_features, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        for b, r, fp32_out in ((None, None, False), (bias, res, False), (bias, None, True)):
            xd = x.to(dtype)
            rd = None if r is None else r.to(torch.float32 if fp32_out else dtype)
            want = QuantizedReference(q, b, fp32_out=fp32_out)(xd, rd)
            bd = None if b is None else b.to(DEVICE)
            got = tri.TritonWq(on(q), bd, fp32_out=fp32_out)(
                xd.to(DEVICE), None if rd is None else rd.to(DEVICE)
            )
            assert got.dtype == want.dtype
            tol = 1e-4 if want.dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)
