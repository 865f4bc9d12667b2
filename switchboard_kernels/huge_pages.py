"""Weights the native kernels stream, and the KV caches they read, held in memory the kernel is
asked to back with 2 MB pages.

Why: a decode step streams every projection's weights once, and on CPU that read is the
step's cost. With 4 KB pages the hardware prefetchers stop at every page boundary and each
page costs a TLB miss; these machines run transparent huge pages in ``madvise`` mode, so
nothing torch allocates gets 2 MB pages unless asked. The default model's batch-1 decode on
a 2-core Zen 4, two engines alternated in one process: bf16 106 vs 89 tok/s, int4 210 vs 171
(docs/performance.md). Weights are small tensors (a few hundred KB to a few
MB each), smaller than a huge page, so they are carved one after another out of shared
chunks of ``CHUNK_BYTES``, each advised before anything touches it. Where ``madvise`` is
missing or refused the memory is ordinary memory: only the speed differs.

A KV cache is one large tensor per layer whose blocks decode attention reads scattered across
it, a TLB miss a block or two on 4 KB pages; it gets advised memory of its own
(``zeros_on_huge_pages``), committed at start as ``torch.zeros`` commits it (2-core Zen 3:
a shuffled 221 MB cache read 7-10% faster at blocks of 16, `python -m bench.decode_attention
--small-pages`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import threading

import torch

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 32 << 20  # a chunk's usable bytes: the most a model can leave unused at its end
ALIGN = 64  # each piece starts on a cache line
MADV_HUGEPAGE = 14  # linux/mman.h


@functools.cache
def _madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class _Chunks:
    """Bump allocation out of advised chunks; a piece holds its chunk alive (a view of it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            start = -(-self._used // ALIGN) * ALIGN
            if self._chunk is None or start + nbytes > self._chunk.numel():
                self._chunk, start = _advised(max(nbytes, CHUNK_BYTES)), 0
            self._used = start + nbytes
            return self._chunk[start : start + nbytes]


def _advised(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh memory, its whole 2 MB pages advised as huge."""
    buffer = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    address = buffer.data_ptr()
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    madvise = _madvise()
    if madvise is not None:
        madvise(start, nbytes // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE)  # a hint: failure is fine
    return buffer[start - address : start - address + nbytes]


_CHUNKS = _Chunks()


def copy_to_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` in advised memory (``t`` itself for an empty or
    non-CPU tensor)."""
    if t.device.type != "cpu" or t.numel() == 0:
        return t
    out = _CHUNKS.take(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed contiguous CPU tensor in advised memory of its own (a KV cache)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    return _advised(nbytes).zero_().view(dtype).view(shape)
