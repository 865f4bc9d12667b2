"""A quantized base's projections on GPU in Triton: a dequantize-GEMM.

Semantics (as ``switchboard_kernels.quantized_linear.QuantizedReference``): ``y = x @ W.T
(+ bias) (+ residual)`` summed in fp32, W[n, k] = (q[n, k] - z[n, g]) s[n, g], g = k // group,
the rows never rounded; y in x's dtype, or fp32 (``fp32_out``). Each program takes a
[BLOCK_M, BLOCK_N] tile of y and walks K in steps of BLOCK_K: it loads the packed levels of its
outputs (4-bit: two features a byte, the low nibble the even one; 8-bit: one a byte),
unpacks and dequantizes them to fp32 in registers with each feature's group's scale and zero,
and multiplies them by the rows' fp32 tile (``tl.dot``, exact fp32: ``input_precision="ieee"``).
The weight is read once per BLOCK_M rows, a quarter (4-bit) or half (8-bit) of bf16's bytes.
Act-order weights have the rows' columns permuted once a call.

Loads are converted to fp32 at once (Triton's CPU interpreter computes bf16 arithmetic wrongly);
``tests/kernels/test_wq_triton.py`` runs it under ``TRITON_INTERPRET=1`` against the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from switchboard_kernels.quantized_weight import QuantizedWeight

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32  # tl.dot needs >= 16 in every dimension


@triton.jit
def _wq_kernel(
    x_ptr,  # [M, K] rows (bf16, fp16 or fp32)
    q_ptr,  # [N, K * bits / 8] uint8 packed levels
    s_ptr,  # [N, G] fp32 scales
    z_ptr,  # [N, G] fp32 zeros
    b_ptr,  # [N] fp32 bias (HAS_BIAS)
    r_ptr,  # [M, N] residual, y's dtype (HAS_RES)
    y_ptr,  # [M, N]
    M,
    N,
    K,
    G,
    group_size,
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_bytes = K * BITS // 8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk  # [BLOCK_K]
        x = tl.load(
            x_ptr + rm[:, None] * K + k[None, :],
            mask=(rm[:, None] < M) & (k[None, :] < K),
            other=0.0,
        ).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        wmask = (rn[:, None] < N) & (k[None, :] < K)
        if BITS == 4:
            byte = tl.load(q_ptr + rn[:, None] * row_bytes + k[None, :] // 2, mask=wmask, other=0)
            level = ((byte.to(tl.int32) >> ((k[None, :] % 2) * 4)) & 15).to(tl.float32)
        else:
            level = tl.load(q_ptr + rn[:, None] * row_bytes + k[None, :], mask=wmask, other=0)
            level = level.to(tl.float32)
        g = k[None, :] // group_size
        s = tl.load(s_ptr + rn[:, None] * G + g, mask=wmask, other=0.0)
        z = tl.load(z_ptr + rn[:, None] * G + g, mask=wmask, other=0.0)
        w = (level - z) * s  # [BLOCK_N, BLOCK_K] fp32, as QuantizedWeight.dequantize
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0)[None, :]
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if HAS_RES:
        acc += tl.load(r_ptr + rm[:, None] * N + rn[None, :], mask=out_mask, other=0.0).to(
            tl.float32
        )
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def pack_rows(q: QuantizedWeight) -> torch.Tensor:
    """Levels [N, K] -> [N, K * bits / 8] uint8 (4-bit: feature 2i in byte i's low nibble)."""
    if q.bits == 8:
        return q.levels.contiguous()
    pairs = q.levels.view(q.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


class TritonWq:
    """``QuantizedReference``'s product through ``_wq_kernel``, the weight held packed on the
    device (``q`` in its stored order, ``input_order`` applied to the rows)."""

    __slots__ = ("bias", "bits", "fp32_out", "group_size", "groups", "in_features", "input_order")
    __slots__ += ("nbytes", "out_features", "packed", "scales", "zeros")

    def __init__(
        self, q: QuantizedWeight, bias: torch.Tensor | None = None, *, fp32_out: bool = False
    ) -> None:
        if q.bits == 4 and q.shape[1] % 2:
            raise ValueError("4-bit weights with an odd number of input features")
        self.out_features, self.in_features = q.shape
        self.bits, self.group_size = q.bits, q.group_size
        self.groups = q.scales.shape[1]
        self.packed = pack_rows(q)
        self.scales, self.zeros = q.scales.contiguous(), q.zeros.contiguous()
        self.input_order = q.input_order
        self.bias = None if bias is None else bias.float().contiguous()
        self.fp32_out = fp32_out
        self.nbytes = q.packed_bytes

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.float32 if self.fp32_out else x.dtype
        if self.input_order is not None:
            x = x.index_select(1, self.input_order.to(x.device))
        x = x.contiguous()
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features, dtype=out, device=x.device)
        res = None if residual is None else residual.to(out).contiguous()
        if rows == 0:
            return y
        grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(self.out_features, BLOCK_N))
        _wq_kernel[grid](
            x,
            self.packed,
            self.scales,
            self.zeros,
            self.bias if self.bias is not None else self.scales,
            res if res is not None else y,
            y,
            rows,
            self.out_features,
            self.in_features,
            self.groups,
            self.group_size,
            BITS=self.bits,
            HAS_BIAS=self.bias is not None,
            HAS_RES=res is not None,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
        )
        return y
