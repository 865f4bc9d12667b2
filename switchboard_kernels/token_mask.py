"""Forbidding tokens in place from a packed bitmask (constrained decoding's last step).

The bitmask is llguidance's (and xgrammar's) layout: int32 words, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed. ``apply_token_bitmask_`` sets every other
token of the chosen logits rows to -inf: the native kernel
(``switchboard_kernels/token_mask_cpu.c``) for fp32 rows on CPU, else torch (unpacked to bools, then
one masked_fill).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from switchboard_kernels import native

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _native_kernel():
    lib = native.load("token_mask_cpu.c")
    if lib is None:
        return None
    kernel = lib.sb_apply_token_bitmask_f32
    kernel.restype = None
    kernel.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64]
    return kernel


def apply_token_bitmask_(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """Forbid in ``logits[rows[i]]`` every token that ``bitmask[i]`` does not allow.

    logits: [num_rows, vocab] (modified); rows: distinct row indices; bitmask: int32
    [len(rows), ceil(vocab / 32)]."""
    vocab = logits.shape[1]
    if bitmask.dtype != np.int32 or bitmask.shape != (len(rows), (vocab + 31) // 32):
        raise ValueError(f"bitmask {bitmask.shape} {bitmask.dtype} for {len(rows)} rows of {vocab}")
    if not rows:
        return
    kernel = _native_kernel() if logits.dtype == torch.float32 and not logits.is_cuda else None
    if kernel is not None and logits.stride(1) == 1:
        index = np.ascontiguousarray(rows, dtype=np.int64)
        if index.min() < 0 or index.max() >= logits.shape[0]:
            raise IndexError(f"rows {rows} outside {logits.shape[0]} logits rows")
        words = np.ascontiguousarray(bitmask)
        kernel(
            logits.data_ptr(), logits.stride(0), index.ctypes.data, words.ctypes.data,
            len(rows), vocab,
        )  # fmt: skip
        return
    allowed = unpack_bitmask(bitmask, vocab).to(logits.device)  # [len(rows), vocab]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bitmask: np.ndarray, vocab: int) -> torch.Tensor:
    """[m, words] int32 bitmask -> [m, vocab] bool (True: allowed)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab].astype(bool))
