"""Punica's batched multi-LoRA kernels (BGMV and SGMV shrink/expand) in Triton.

Punica (Chen et al., "Punica: Multi-Tenant LoRA Serving", MLSys 2024). Same signatures
and semantics as ``switchboard_kernels/lora_reference.py``; the layout of the adapter stacks is
described there. Every kernel converts what it loads to fp32 at once and accumulates in
fp32: Triton's CPU interpreter computes bf16 arithmetic wrongly, and fp32 accumulation is
what the references compute.

- BGMV (decode): each program takes BLOCK_M tokens, gathers each token's own A or B rows
  by its slot, and reduces a broadcast product with ``tl.sum`` (no ``tl.dot``: the tokens
  of one tile need not share an adapter). ``BgmvBlocks`` sizes the programs: one token
  and large tiles on a GPU, a few tokens and small tiles in the interpreter.
- SGMV (prefill): the grid is (segment, token block within it, rank or output block); all
  tokens of a program share one adapter, so the tile is a ``tl.dot``. Tiles are at least
  16 in every dimension (``tl.dot``'s minimum on GPU) and loads are masked with zeros past
  the rank, the segment and the features, so any ``max_rank`` (1-64 tested) works without
  padding the stacks to a multiple of 16.
- fp32 inputs use ``input_precision="ieee"`` (exact fp32, not TF32); fp16/bf16 inputs use
  TF32, which holds their values exactly.

To run the kernels on CPU tensors, set ``TRITON_INTERPRET=1`` before triton is first imported
(triton.language's own jit helpers, such as ``tl.zeros``, are decorated then);
``tests/kernels/test_lora_kernels.py`` does. ``switchboard_kernels.lora`` imports this module only
for CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from switchboard_kernels.lora_shapes import check_expand, check_shrink

SGMV_BLOCK_K = 64  # input features per step of the shrink loop
SGMV_BLOCK_N = 64  # output features per expand program
MIN_DOT = 16  # tl.dot needs every tile dimension >= 16


@dataclass(frozen=True, slots=True)
class BgmvBlocks:
    """How BGMV splits its work into programs.

    ``block_m`` tokens per program, each gathering its own adapter rows into a
    [block_m, rank or output block, input block] tile of about ``tile`` fp32 elements;
    ``shrink_rank_block`` rank rows per shrink program (None: the whole rank up to 64).
    """

    block_m: int
    tile: int
    shrink_rank_block: int | None

    @classmethod
    def for_device(cls, device: torch.device) -> BgmvBlocks:
        return GPU_BGMV if device.type == "cuda" else INTERPRETER_BGMV


# On a GPU, a program per token with large tiles, and the shrink spread over rank blocks of
# 16 so one decoding sequence still fills several multiprocessors. The interpreter's
# blocks (4 tokens, 2,048 elements) made one program walk a 4096-wide input 8 columns at
# a time, several times slower on an H200 (bench.lora_triton). Of the sizes tried (tiles
# of 4,096-16,384 elements, 1-2 tokens, the rank whole or in blocks of 16) this was the
# fastest in most rows and close to it in the rest (docs/performance.md).
GPU_BGMV = BgmvBlocks(block_m=1, tile=16384, shrink_rank_block=MIN_DOT)
# In the CPU interpreter a program costs Python time: fewer, smaller ones.
INTERPRETER_BGMV = BgmvBlocks(block_m=4, tile=2048, shrink_rank_block=None)


@triton.jit
def gathered_shrink(
    x_ptr, a_ptr, slot, use, offs_m, offs_r, r_mask, in_features,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``h[m, r] = sum_k x[m, k] * A[slot_m, r, k]`` in fp32, each token with its own A
    rows (rows where ``use`` is false load zeros); shared by BGMV and the fused kernel."""
    x_rows = x_ptr + offs_m[:, None] * stride_xt  # [BM, 1]
    a_rows = a_ptr + slot[:, None, None] * stride_as + offs_r[None, :, None] * stride_ar
    a_mask = use[:, None, None] & r_mask[None, :, None]  # [BM, BR, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        x = tl.load(x_rows + k[None, :] * stride_xk, mask=use[:, None] & k_mask[None, :], other=0.0)
        x = x.to(tl.float32)  # [BM, BK]
        a = tl.load(
            a_rows + k[None, None, :] * stride_ak, mask=a_mask & k_mask[None, None, :], other=0.0
        )
        a = a.to(tl.float32)  # [BM, BR, BK]: each token's own A rows
        acc += tl.sum(x[:, None, :] * a, axis=2)
    return acc


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, a_ptr, slots_ptr, out_ptr,
    num_tokens, in_features, rank,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ot, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_mask = offs_m < num_tokens
    r_mask = offs_r < rank
    slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1)
    use = m_mask & (slot >= 0)  # rows without an adapter load zeros and store zeros
    slot = tl.where(use, slot, 0)
    acc = gathered_shrink(
        x_ptr, a_ptr, slot, use, offs_m, offs_r, r_mask, in_features,
        stride_xt, stride_xk, stride_as, stride_ar, stride_ak,
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    out = out_ptr + offs_m[:, None] * stride_ot + offs_r[None, :] * stride_or
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _bgmv_expand_kernel(
    y_ptr, x_ptr, b_ptr, slots_ptr, scales_ptr,
    num_tokens, out_features, rank, out_offset,
    stride_yt, stride_yn, stride_xt, stride_xr, stride_bs, stride_bn, stride_br,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < num_tokens
    n_mask = offs_n < out_features
    slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1)
    use = m_mask & (slot >= 0)  # rows without an adapter are neither loaded nor stored
    slot = tl.where(use, slot, 0)
    b_rows = b_ptr + slot[:, None, None] * stride_bs + offs_n[None, :, None] * stride_bn
    b_mask = use[:, None, None] & n_mask[None, :, None]  # [BM, BN, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < rank
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xt + r[None, :] * stride_xr,
            mask=use[:, None] & r_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BM, BR]
        b = tl.load(
            b_rows + r[None, None, :] * stride_br, mask=b_mask & r_mask[None, None, :], other=0.0
        )
        b = b.to(tl.float32)  # [BM, BN, BR]: each token's own B rows
        acc += tl.sum(x[:, None, :] * b, axis=2)
    acc *= tl.load(scales_ptr + slot, mask=use, other=0.0).to(tl.float32)[:, None]
    y = y_ptr + offs_m[:, None] * stride_yt + (out_offset + offs_n)[None, :] * stride_yn
    y_mask = use[:, None] & n_mask[None, :]
    total = tl.load(y, mask=y_mask, other=0.0).to(tl.float32) + acc
    tl.store(y, total.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, a_ptr, seg_starts_ptr, seg_slots_ptr, out_ptr,
    in_features, rank,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ot, stride_or,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    slot = tl.load(seg_slots_ptr + seg)
    row0 = start + tl.program_id(1) * BLOCK_M
    if row0 >= end:  # this segment is shorter than the longest one
        return
    if slot < 0:  # no adapter: the output was zero-initialized
        return
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_mask = offs_m < end
    r_mask = offs_r < rank
    a_cols = a_ptr + slot * stride_as + offs_r[None, :] * stride_ar  # A.T tile: [1, BR]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xt + k[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BM, BK]
        a = tl.load(
            a_cols + k[:, None] * stride_ak, mask=k_mask[:, None] & r_mask[None, :], other=0.0
        )
        acc += tl.dot(x, a.to(tl.float32), input_precision=PRECISION)  # a: [BK, BR]
    out = out_ptr + offs_m[:, None] * stride_ot + offs_r[None, :] * stride_or
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _sgmv_expand_kernel(
    y_ptr, x_ptr, b_ptr, seg_starts_ptr, seg_slots_ptr, scales_ptr,
    out_features, rank, out_offset,
    stride_yt, stride_yn, stride_xt, stride_xr, stride_bs, stride_bn, stride_br,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    slot = tl.load(seg_slots_ptr + seg)
    row0 = start + tl.program_id(1) * BLOCK_M
    if row0 >= end:
        return
    if slot < 0:  # no adapter: y stays as it is
        return
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < end
    n_mask = offs_n < out_features
    b_cols = b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn  # B.T tile: [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < rank
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xt + r[None, :] * stride_xr,
            mask=m_mask[:, None] & r_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BM, BR]
        b = tl.load(
            b_cols + r[:, None] * stride_br, mask=r_mask[:, None] & n_mask[None, :], other=0.0
        )
        acc += tl.dot(x, b.to(tl.float32), input_precision=PRECISION)  # b: [BR, BN]
    acc *= tl.load(scales_ptr + slot).to(tl.float32)
    y = y_ptr + offs_m[:, None] * stride_yt + (out_offset + offs_n)[None, :] * stride_yn
    y_mask = m_mask[:, None] & n_mask[None, :]
    total = tl.load(y, mask=y_mask, other=0.0).to(tl.float32) + acc
    tl.store(y, total.to(y_ptr.dtype.element_ty), mask=y_mask)


def _rank_block(rank: int) -> int:
    """The whole rank in one block up to 64 (larger ranks loop or tile), at least 16 wide.

    16 is tl.dot's minimum; BGMV keeps it too, which spares GPU layouts of 1-wide tiles at
    the cost of masked lanes for ranks below 16.
    """
    return max(MIN_DOT, triton.next_power_of_2(min(rank, 64)))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _segment_grid_rows(seg_starts: torch.Tensor, max_seg_len: int | None, block_m: int) -> int:
    if max_seg_len is None:  # a device sync on GPU: pass LoraMapping.max_seg_len instead
        max_seg_len = int((seg_starts[1:] - seg_starts[:-1]).max()) if seg_starts.numel() > 1 else 0
    return triton.cdiv(max_seg_len, block_m)


def _sgmv_block_m(max_seg_len: int | None) -> int:
    """Token rows per SGMV program: 16 to 64, no more than the longest segment needs."""
    return min(64, max(MIN_DOT, triton.next_power_of_2(max_seg_len or 1)))


def bgmv_shrink(
    x: torch.Tensor,  # [T, in] fp32/fp16/bf16
    a_stack: torch.Tensor,  # [S, R, in], x's dtype
    token_slots: torch.Tensor,  # [T] int64, -1 = no adapter
    *,
    blocks: BgmvBlocks | None = None,  # None: as BgmvBlocks.for_device picks
) -> torch.Tensor:  # [T, R], x's dtype
    """Semantics: ``out[t] = x[t] @ a_stack[s_t].T`` if ``s_t >= 0`` else 0."""
    check_shrink(x, a_stack)
    blocks = blocks or BgmvBlocks.for_device(x.device)
    num_tokens, rank = x.shape[0], a_stack.shape[1]
    out = torch.empty(num_tokens, rank, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block_r = blocks.shrink_rank_block or _rank_block(rank)
    block_k = max(MIN_DOT, blocks.tile // (blocks.block_m * block_r))
    grid = (triton.cdiv(num_tokens, blocks.block_m), triton.cdiv(rank, block_r))
    _bgmv_shrink_kernel[grid](
        x, a_stack, token_slots, out,
        num_tokens, x.shape[1], rank,
        *x.stride(), *a_stack.stride(), *out.stride(),
        BLOCK_M=blocks.block_m, BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip
    return out


def bgmv_expand(
    y: torch.Tensor,  # [T, out_total], updated in place
    x: torch.Tensor,  # [T, R], the shrink output
    b_stack: torch.Tensor,  # [S, out, R]
    token_slots: torch.Tensor,  # [T] int64, -1 = no adapter
    scales: torch.Tensor,  # [S] float32
    *,
    out_offset: int = 0,
    blocks: BgmvBlocks | None = None,  # None: as BgmvBlocks.for_device picks
) -> None:
    """Semantics: ``y[t, o:o+out] += scales[s_t] * (x[t] @ b_stack[s_t].T)`` for ``s_t >= 0``."""
    check_expand(y, x.shape, b_stack, out_offset)
    blocks = blocks or BgmvBlocks.for_device(y.device)
    num_tokens, out_features, rank = x.shape[0], b_stack.shape[1], b_stack.shape[2]
    if num_tokens == 0:
        return
    block_r = _rank_block(rank)
    block_n = max(MIN_DOT, blocks.tile // (blocks.block_m * block_r))
    grid = (triton.cdiv(num_tokens, blocks.block_m), triton.cdiv(out_features, block_n))
    _bgmv_expand_kernel[grid](
        y, x, b_stack, token_slots, scales,
        num_tokens, out_features, rank, out_offset,
        *y.stride(), *x.stride(), *b_stack.stride(),
        BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_R=block_r,
    )  # fmt: skip


def sgmv_shrink(
    x: torch.Tensor,  # [T, in] fp32/fp16/bf16
    a_stack: torch.Tensor,  # [S, R, in], x's dtype
    seg_starts: torch.Tensor,  # [num_segments + 1] int64, non-decreasing token offsets
    seg_slots: torch.Tensor,  # [num_segments] int64, -1 = no adapter
    *,
    max_seg_len: int | None = None,  # longest segment; None costs a device sync
) -> torch.Tensor:  # [T, R], x's dtype
    """Semantics: ``out[i:j] = x[i:j] @ a_stack[s].T`` per segment [i, j) of slot s >= 0, else 0."""
    check_shrink(x, a_stack)
    rank = a_stack.shape[1]
    out = torch.zeros(x.shape[0], rank, dtype=x.dtype, device=x.device)
    block_m = _sgmv_block_m(max_seg_len)
    block_r = _rank_block(rank)
    grid = (
        seg_slots.shape[0],
        _segment_grid_rows(seg_starts, max_seg_len, block_m),
        triton.cdiv(rank, block_r),
    )
    if min(grid) == 0:
        return out
    _sgmv_shrink_kernel[grid](
        x, a_stack, seg_starts, seg_slots, out,
        x.shape[1], rank,
        *x.stride(), *a_stack.stride(), *out.stride(),
        PRECISION=_precision(x.dtype), BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=SGMV_BLOCK_K,
    )  # fmt: skip
    return out


def sgmv_expand(
    y: torch.Tensor,  # [T, out_total], updated in place
    x: torch.Tensor,  # [T, R]
    b_stack: torch.Tensor,  # [S, out, R]
    seg_starts: torch.Tensor,  # [num_segments + 1] int64
    seg_slots: torch.Tensor,  # [num_segments] int64, -1 = no adapter
    scales: torch.Tensor,  # [S] float32
    *,
    out_offset: int = 0,
    max_seg_len: int | None = None,  # longest segment; None costs a device sync
) -> None:
    """Semantics: ``y[i:j, o:o+out] += scales[s] * (x[i:j] @ b_stack[s].T)`` per segment, s >= 0."""
    check_expand(y, x.shape, b_stack, out_offset)
    out_features, rank = b_stack.shape[1], b_stack.shape[2]
    block_m = _sgmv_block_m(max_seg_len)
    rows = _segment_grid_rows(seg_starts, max_seg_len, block_m)
    grid = (seg_slots.shape[0], rows, triton.cdiv(out_features, SGMV_BLOCK_N))
    if min(grid) == 0:
        return
    _sgmv_expand_kernel[grid](
        y, x, b_stack, seg_starts, seg_slots, scales,
        out_features, rank, out_offset,
        *y.stride(), *x.stride(), *b_stack.stride(),
        PRECISION=_precision(x.dtype), BLOCK_M=block_m, BLOCK_N=SGMV_BLOCK_N,
        BLOCK_R=_rank_block(rank),
    )  # fmt: skip


@triton.jit
def _dora_rescale_kernel(
    y_ptr, scales_ptr, enabled_ptr, slots_ptr, base_ptr,
    num_tokens, out_features,
    stride_yt, stride_yn, stride_ss, stride_sn, stride_zt, stride_zn,
    HAS_BASE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < num_tokens
    slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1)
    live = m_mask & (slot >= 0)
    slot = tl.where(live, slot, 0)
    use = live & (tl.load(enabled_ptr + slot, mask=live, other=0) != 0)  # DoRA rows only
    mask = use[:, None] & (offs_n < out_features)[None, :]
    g = tl.load(
        scales_ptr + slot[:, None] * stride_ss + offs_n[None, :] * stride_sn, mask=mask, other=1.0
    ).to(tl.float32)
    y = y_ptr + offs_m[:, None] * stride_yt + offs_n[None, :] * stride_yn
    v = tl.load(y, mask=mask, other=0.0).to(tl.float32)
    if HAS_BASE:
        z_at = base_ptr + offs_m[:, None] * stride_zt + offs_n[None, :] * stride_zn
        z = tl.load(z_at, mask=mask, other=0.0).to(tl.float32)
        v = z + g * (v - z)
    else:
        v = g * v
    tl.store(y, v.to(y_ptr.dtype.element_ty), mask=mask)


def dora_rescale(
    y: torch.Tensor,  # [T, >= out], updated in place
    scales: torch.Tensor,  # [S, out] float32
    enabled: torch.Tensor,  # [S] int64
    token_slots: torch.Tensor,  # [T] int64, -1 = no adapter
    *,
    base: torch.Tensor | None = None,  # [out] or [T, out], y's dtype
) -> None:
    """Semantics: ``y[t, :out] = z_t + scales[s_t] * (y[t, :out] - z_t)`` for ``s_t >= 0`` with
    ``enabled[s_t]`` (z = base, or 0); other rows untouched (as the reference)."""
    num_tokens, out_features = y.shape[0], scales.shape[1]
    if y.dim() != 2 or y.shape[1] < out_features or token_slots.shape[0] != num_tokens:
        raise ValueError(f"DoRA: y {tuple(y.shape)} does not fit scales {tuple(scales.shape)}")
    if num_tokens == 0:
        return
    if base is None:
        z, z_strides = y, (0, 0)
    elif base.dim() == 1 and base.shape[0] == out_features:
        z, z_strides = base, (0, base.stride(0))  # one vector (a bias) for every row
    elif base.dim() == 2 and base.shape == (num_tokens, out_features):
        z, z_strides = base, tuple(base.stride())
    else:
        raise ValueError(f"DoRA: base {tuple(base.shape)} does not fit y {tuple(y.shape)}")
    on_gpu = y.device.type == "cuda"
    block_m, block_n = (16, 128) if on_gpu else (4, 32)
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(out_features, block_n))
    _dora_rescale_kernel[grid](
        y, scales, enabled, token_slots, z,
        num_tokens, out_features,
        *y.stride(), *scales.stride(), *z_strides,
        HAS_BASE=base is not None, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
