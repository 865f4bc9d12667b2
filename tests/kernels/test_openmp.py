"""switchboard_kernels.openmp: a thread made serial runs its OpenMP regions alone, and the
engine's thread keeps its team."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from switchboard_kernels.openmp import openmp_threads_here, serial_openmp_here

pytestmark = pytest.mark.skipif(openmp_threads_here() is None, reason="torch without libgomp")


def test_a_serial_thread_runs_its_regions_alone_and_the_main_thread_keeps_its_team():
    before = openmp_threads_here()
    assert before == torch.get_num_threads()

    def in_pool() -> tuple[int | None, int, float]:
        x = torch.randn(256, 256)
        return openmp_threads_here(), torch.get_num_threads(), float((x @ x).sum())

    with ThreadPoolExecutor(1, initializer=serial_openmp_here) as pool:
        threads, torch_threads, _ = pool.submit(in_pool).result()
    assert (threads, torch_threads) == (1, 1)
    with ThreadPoolExecutor(1) as pool:  # a thread left as it is gets the process's count
        assert pool.submit(openmp_threads_here).result() == before
    assert openmp_threads_here() == before == torch.get_num_threads()
