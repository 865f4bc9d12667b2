"""BGMV shrink and expand of one LoRA group in a single Triton kernel (decode steps).

The split pair (``switchboard_kernels/lora_triton.py``) launches twice per group and writes the
shrink output to memory between the launches: 240 launches a default-model decode step. Here
each program computes its tokens' shrink ``h = x @ A[s].T`` (the whole rank, in fp32
registers: it is never rounded to the activations' dtype, so the result is at least as
close to the fp32 reference as the pair's) and then adds ``scale * h @ B[s].T`` into its
share of the output columns. Same semantics as ``bgmv_shrink`` followed by ``bgmv_expand``.

A program covers ``block_m`` tokens and a contiguous share of the output columns; with
several shares per token, each share recomputes the shrink (rank x in multiply-adds, A
read again from cache) to spread a small batch over more of the GPU. ``FusedBlocks``
chooses; ``bench/lora_triton.py`` times every choice against the split pair on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from switchboard_kernels.lora import FUSED_MAX_RANK
from switchboard_kernels.lora_shapes import check_expand, check_shrink
from switchboard_kernels.lora_triton import gathered_shrink

MIN_TILE = 16  # every tile dimension, as in switchboard_kernels/lora_triton.py


@dataclass(frozen=True, slots=True)
class FusedBlocks:
    """``block_m`` tokens per program; tiles of about ``tile`` fp32 elements; enough output
    shares per token that the grid has ``target_programs`` programs (at most one share per
    output block, at least one)."""

    block_m: int
    tile: int
    target_programs: int

    @classmethod
    def for_device(cls, device: torch.device) -> FusedBlocks:
        if device.type != "cuda":
            return INTERPRETER_FUSED
        return _gpu_blocks(device.index if device.index is not None else 0)

    def shares(self, num_tokens: int, out_features: int, block_n: int) -> int:
        token_programs = triton.cdiv(num_tokens, self.block_m)
        wanted = triton.cdiv(self.target_programs, token_programs)
        return max(1, min(wanted, triton.cdiv(out_features, block_n)))


@functools.cache
def _gpu_blocks(device_index: int) -> FusedBlocks:
    """One token per program, BGMV's GPU tiles, four programs per multiprocessor."""
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return FusedBlocks(block_m=1, tile=16384, target_programs=4 * sms)


# In the CPU interpreter every program costs Python time: few, small ones.
INTERPRETER_FUSED = FusedBlocks(block_m=4, tile=2048, target_programs=1)


@triton.jit
def _bgmv_fused_kernel(
    y_ptr, x_ptr, a_ptr, b_ptr, slots_ptr, scales_ptr,
    num_tokens, in_features, out_features, rank, out_offset, cols_per_share,
    stride_yt, stride_yn, stride_xt, stride_xk, stride_as, stride_ar, stride_ak,
    stride_bs, stride_bn, stride_br,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < num_tokens
    slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1)
    use = m_mask & (slot >= 0)  # rows without an adapter are neither loaded nor stored
    slot = tl.where(use, slot, 0)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    h = gathered_shrink(
        x_ptr, a_ptr, slot, use, offs_m, offs_r, r_mask, in_features,
        stride_xt, stride_xk, stride_as, stride_ar, stride_ak,
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    h *= tl.load(scales_ptr + slot, mask=use, other=0.0).to(tl.float32)[:, None]
    # Expand this program's share of the columns: y[m, n] += sum_r h[m, r] * B[s_m, n, r].
    b_rows = b_ptr + slot[:, None, None] * stride_bs + offs_r[None, None, :] * stride_br
    b_mask = use[:, None, None] & r_mask[None, None, :]  # [BM, 1, BR]
    first = tl.program_id(1) * cols_per_share
    last = tl.minimum(first + cols_per_share, out_features)
    for n0 in range(first, last, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < last
        b = tl.load(
            b_rows + n[None, :, None] * stride_bn, mask=b_mask & n_mask[None, :, None], other=0.0
        )
        delta = tl.sum(h[:, None, :] * b.to(tl.float32), axis=2)  # [BM, BN]
        y = y_ptr + offs_m[:, None] * stride_yt + (out_offset + n)[None, :] * stride_yn
        y_mask = use[:, None] & n_mask[None, :]
        total = tl.load(y, mask=y_mask, other=0.0).to(tl.float32) + delta
        tl.store(y, total.to(y_ptr.dtype.element_ty), mask=y_mask)


def bgmv_fused(
    y: torch.Tensor,  # [T, out_total], updated in place
    x: torch.Tensor,  # [T, in] fp32/fp16/bf16
    a_stack: torch.Tensor,  # [S, R, in], x's dtype
    b_stack: torch.Tensor,  # [S, out, R]
    token_slots: torch.Tensor,  # [T] int64, -1 = no adapter
    scales: torch.Tensor,  # [S] float32
    *,
    out_offset: int = 0,
    blocks: FusedBlocks | None = None,  # None: as FusedBlocks.for_device picks
) -> None:
    """Semantics: ``y[t, o:o+out] += scales[s] * x[t] @ a_stack[s].T @ b_stack[s].T`` for
    ``s = token_slots[t] >= 0``; the rank may not exceed ``FUSED_MAX_RANK``."""
    check_shrink(x, a_stack)
    num_tokens, rank = x.shape[0], a_stack.shape[1]
    check_expand(y, (num_tokens, rank), b_stack, out_offset)
    if rank > FUSED_MAX_RANK:
        raise ValueError(f"rank {rank} is above the fused kernel's {FUSED_MAX_RANK}")
    if num_tokens == 0:
        return
    blocks = blocks or FusedBlocks.for_device(y.device)
    out_features = b_stack.shape[1]
    block_r = max(MIN_TILE, triton.next_power_of_2(rank))
    block_k = max(MIN_TILE, blocks.tile // (blocks.block_m * block_r))
    block_n = max(MIN_TILE, blocks.tile // (blocks.block_m * block_r))
    shares = blocks.shares(num_tokens, out_features, block_n)
    cols_per_share = triton.cdiv(triton.cdiv(out_features, shares), block_n) * block_n
    grid = (triton.cdiv(num_tokens, blocks.block_m), triton.cdiv(out_features, cols_per_share))
    _bgmv_fused_kernel[grid](
        y, x, a_stack, b_stack, token_slots, scales,
        num_tokens, x.shape[1], out_features, rank, out_offset, cols_per_share,
        *y.stride(), *x.stride(), *a_stack.stride(), *b_stack.stride(),
        BLOCK_M=blocks.block_m, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n,
    )  # fmt: skip
