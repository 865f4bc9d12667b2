"""Building the native CPU kernels (switchboard_kernels/native.py): cached per source and CPU, and a
machine without a working compiler falls back to the torch paths with one warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from switchboard_kernels import native
from switchboard_kernels.lora import NativeSlots
from switchboard_kernels.lora_native import native_library


@pytest.fixture
def fresh_loads():
    """Forget what this process loaded; restore it after (other tests share the cache)."""
    native.load.cache_clear()
    native_library.cache_clear()
    yield
    native.load.cache_clear()
    native_library.cache_clear()


@pytest.mark.skipif(native.load("lora_cpu.c") is None, reason="no C compiler here")
def test_a_source_is_built_once_per_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    source = Path(native.__file__).with_name("lora_cpu.c")
    built = native.build(source)
    assert built.parent == tmp_path and built.name.startswith("lora_cpu-")
    mtime = built.stat().st_mtime_ns
    assert native.build(source) == built and built.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no temporaries left


def test_a_broken_compiler_means_the_torch_paths(tmp_path, monkeypatch, caplog, fresh_loads):
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="switchboard_kernels.native"):
        assert native_library() is None
    assert "native kernel lora_cpu.c unavailable" in caplog.text
    assert not NativeSlots.wanted(torch.zeros(1, dtype=torch.bfloat16))
    assert list(tmp_path.iterdir()) == []


def test_the_native_kernels_can_be_switched_off(monkeypatch, fresh_loads):
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert native.load("lora_cpu.c") is None and native_library() is None


def test_the_vector_loops_are_built_where_the_cpu_has_them():
    """Tests run each kernel's "vector" and "portable" loops; on an AVX-512 CPU the first
    must really be the AVX-512 ones (a build without them would test plain C twice)."""
    from switchboard_kernels.attention_native import native_attention

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    kernels = [native_library(), native_attention()]
    if "avx512f" not in flags or None in kernels:
        pytest.skip("no AVX-512 here, or no compiler")
    assert all(kernel.has_avx512 for kernel in kernels)
