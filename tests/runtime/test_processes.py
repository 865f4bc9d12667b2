"""Ending child processes: runtime.processes."""

import signal
import subprocess
import sys

from runtime.processes import stop_process

IGNORES_SIGTERM = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_child_that_exits_on_sigterm_is_reaped_with_its_own_status():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stop_process(child, 10)
    assert child.returncode == -signal.SIGTERM


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period():
    child = subprocess.Popen(
        [sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline() == "ready\n"  # its handler is in place
    stop_process(child, 0.5)
    assert child.returncode == -signal.SIGKILL
    child.stdout.close()


def test_stopping_a_child_that_already_exited_keeps_its_status():
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    child.wait()
    stop_process(child, 1)
    assert child.returncode == 3
