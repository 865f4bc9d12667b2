"""Ending child processes: a grace period after SIGTERM, then SIGKILL, always reaped."""

from __future__ import annotations

import subprocess


def reap(process: subprocess.Popen, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for ``process`` to exit, then kill it; either way it
    is waited for, so no zombie is left."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def stop_process(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM ``process`` (if it still runs), then ``reap`` it."""
    if process.poll() is None:
        process.terminate()
    reap(process, timeout)
