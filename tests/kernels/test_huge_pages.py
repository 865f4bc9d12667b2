"""switchboard_kernels/huge_pages.py: weights copied into memory advised as 2 MB pages.

What can be checked everywhere is that the copies are the tensors they copy, each on its own
cache-line-aligned bytes, whatever else shares their chunk (whether the kernel grants huge
pages is its decision; bench.decode_step and docs/performance.md measure what it buys)."""

from __future__ import annotations

import itertools

import torch

from switchboard_kernels.huge_pages import (
    ALIGN,
    CHUNK_BYTES,
    HUGE_PAGE,
    copy_to_huge_pages,
    zeros_on_huge_pages,
)


def test_copies_equal_their_tensors_and_never_overlap():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, 7, generator=gen).to(dtype) for n in (1, 33, 5000) for dtype in (
        torch.float32, torch.bfloat16)]  # fmt: skip
    tensors.append(torch.randint(0, 255, (3, 11), generator=gen, dtype=torch.uint8))
    copies = [copy_to_huge_pages(t) for t in tensors]
    spans = []
    for t, c in zip(tensors, copies, strict=True):
        assert torch.equal(c, t) and c.dtype == t.dtype and c.is_contiguous()
        assert c.data_ptr() % ALIGN == 0
        spans.append((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    for t in tensors:  # the copies do not alias their sources
        t.zero_()
    assert all(c.abs().sum() > 0 for c in copies)


def test_a_tensor_larger_than_a_chunk_and_a_strided_one():
    big = torch.arange(CHUNK_BYTES // 4 + 10, dtype=torch.float32)
    assert torch.equal(copy_to_huge_pages(big), big)
    strided = torch.arange(24, dtype=torch.float32).view(4, 6).t()
    copy = copy_to_huge_pages(strided)
    assert torch.equal(copy, strided) and copy.is_contiguous()
    empty = torch.empty(0, 3)
    assert copy_to_huge_pages(empty) is empty


def test_a_cache_of_zeros_on_its_own_pages():
    shape = (5, 16, 3, 64)
    for dtype in (torch.bfloat16, torch.float32):
        one, two = zeros_on_huge_pages(shape, dtype), zeros_on_huge_pages(shape, dtype)
        assert one.shape == shape and one.dtype == dtype and one.is_contiguous()
        assert not one.any() and one.data_ptr() % HUGE_PAGE == 0
        one.fill_(1)  # each its own memory
        assert not two.any()
    assert zeros_on_huge_pages((0, 16, 3, 64), torch.float32).numel() == 0
