"""What the kernel benches share: another version of one of our C sources, built beside copies
of our headers (a bench's ``--against FILE``), and a co-runner that takes a core for moments
(``--beside-spinner``), as a server's other threads and processes do."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from switchboard_kernels import native

# The co-runner: sleeps 1-4 ms, then spins for the given seconds, until killed.
_SPINNER = """
import random, sys, time
spin = float(sys.argv[1])
while True:
    time.sleep(random.uniform(0.001, 0.004))
    start = time.perf_counter()
    while time.perf_counter() - start < spin:
        pass
"""


def build_other(source: Path, as_name: str) -> ctypes.CDLL:
    """``source`` built as ``switchboard_kernels/<as_name>`` would be, beside our headers."""
    here = Path(native.__file__).parent
    folder = Path(tempfile.mkdtemp(prefix="sb-kernel-"))
    for header in here.glob("*.h"):
        shutil.copy(header, folder)
    shutil.copy(source, folder / as_name)
    return ctypes.CDLL(str(native.build(folder / as_name)))


def start_spinner(spin_s: float) -> subprocess.Popen:
    """A process that spins ``spin_s`` seconds every 1-4 ms (kill it when done)."""
    return subprocess.Popen([sys.executable, "-c", _SPINNER, str(spin_s)])
