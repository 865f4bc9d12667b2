"""Native CPU kernels: our C sources, built on first use and loaded with ctypes.

A source is compiled with the host's C compiler and ``-march=native`` into a per-user cache
(``$SWITCHBOARD_KERNEL_CACHE``, else ``~/.cache/switchboard/kernels``), keyed by the
source and the headers beside it, the flags, the compiler and the CPU. We do not use
``torch.utils.cpp_extension``: the kernels need raw pointers only, and compiling against
torch's C++ headers takes about a minute on two cores where this takes a second. Where no
compiler works (or ``SWITCHBOARD_NATIVE_KERNELS=0``), ``load`` returns None, says why once
in the log, and the torch paths serve instead.

The kernels' OpenMP loops share torch's runtime: torch loads its ``libgomp.so.1`` first,
and the dynamic linker resolves ours to the same soname, so both use one thread pool (and
``torch.set_num_threads`` sizes it for both).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC")
DISABLE_ENV = "SWITCHBOARD_NATIVE_KERNELS"
CACHE_ENV = "SWITCHBOARD_KERNEL_CACHE"


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off")


@functools.cache
def load(source: str) -> ctypes.CDLL | None:
    """``switchboard_kernels/<source>`` built and loaded, once per process; None where it
    cannot be."""
    if disabled():
        return None
    try:
        return ctypes.CDLL(str(build(Path(__file__).with_name(source))))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("native kernel %s unavailable (%s); using the torch paths", source, exc)
        return None


def build(source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared library for ``source`` in the cache, compiled if it is not there yet.
    ``extra_flags`` follow ``CFLAGS`` (tests build a kernel's other paths with them)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found (set CC)")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # #include "..."
    flags = (*CFLAGS, *extra_flags)
    for part in (source.read_bytes(), *headers, " ".join(flags).encode(), version.encode()):
        key.update(part)
    key.update(_cpu_id())
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache/switchboard/kernels")
    target = cache / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name, then rename: concurrent processes never load half a file.
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *flags, str(source), "-o", str(built)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


def _cpu_id() -> bytes:
    """What -march=native depends on: a cache shared across hosts keeps one build per CPU."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor().encode()
    wanted = {line for line in info.splitlines() if line.startswith(("model name", "flags"))}
    return "\n".join(sorted(wanted)).encode()


def checked_rows(
    name: str,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    *,
    in_features: int,
    out_features: int,
    dtypes: tuple[torch.dtype, ...],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A native projection's inputs as the kernel reads them: ``x`` as contiguous CPU rows of
    ``in_features`` in one of ``dtypes``, and ``residual`` ([rows, out_features], x's
    dtype) contiguous, or None (the caller holds both while the kernel runs). Checks kept
    to what guards the kernel's memory accesses: projections run ~120 times a decode step
    of the default model."""
    if x.dtype not in dtypes or x.dim() != 2 or x.shape[1] != in_features or x.is_cuda:
        names = " or ".join({torch.bfloat16: "bf16", torch.float32: "fp32"}[d] for d in dtypes)
        raise ValueError(
            f"{name}: x {tuple(x.shape)} {x.dtype} on {x.device}: {names} CPU rows of "
            f"{in_features} features"
        )
    x = x.contiguous()
    if residual is None:
        return x, None
    if residual.dtype != x.dtype or residual.shape != (x.shape[0], out_features):
        names = {torch.bfloat16: "bf16", torch.float32: "fp32"}[x.dtype]
        raise ValueError(f"{name}: residual must be {names} ({x.shape[0]}, {out_features})")
    return x, residual.contiguous()
