"""Keep OpenMP's parallel regions to one thread of the process: the one that runs the steps.

torch's OpenMP runtime (libgomp, shared by our kernels: ``switchboard_kernels.native``) gives
each thread that starts a parallel region a team of its own, and the team's threads live as
long as that thread does. Once the process holds more of those threads than it has CPUs,
libgomp stops letting idle team threads spin between regions (its "throttled" spin count):
they sleep, and every region of every team pays to wake them. A worker whose engine was built
on a pool thread, which stayed alive, decoded one stream at ~13 ms a token on a 2-core Zen 5
instead of ~8.5 ms (bench/README.md). Threads other than the engine's call
``serial_openmp_here`` first: their regions then run on themselves alone and start no team.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

logger = logging.getLogger(__name__)

LIBGOMP = "libgomp.so.1"


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """torch's libgomp, if it is the OpenMP runtime loaded here (never loads one)."""
    import torch  # noqa: F401  (loads the runtime it was built with)

    try:
        lib = ctypes.CDLL(LIBGOMP, mode=os.RTLD_NOLOAD)
    except OSError:
        logger.info("no %s loaded (another OpenMP runtime?): threads left as they are", LIBGOMP)
        return None
    lib.omp_set_num_threads.argtypes = [ctypes.c_int]
    lib.omp_get_max_threads.restype = ctypes.c_int
    return lib


def serial_openmp_here() -> None:
    """The calling thread's OpenMP regions (torch's ops and our kernels) run on it alone.

    libgomp keeps the thread count per thread once set (its ICVs are the calling task's), so
    the engine's thread keeps its team. Not ``torch.set_num_threads(1)``: that also sets
    torch's process-wide count, which later threads start from."""
    lib = _libgomp()
    if lib is not None:
        lib.omp_set_num_threads(1)


def openmp_threads_here() -> int | None:
    """How many threads a parallel region started here would get (None: no libgomp)."""
    lib = _libgomp()
    return None if lib is None else lib.omp_get_max_threads()
