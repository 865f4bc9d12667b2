"""`switchboard up` as `make run` starts it: Ctrl-C on its process group stops the stack, and
a restart on the same Redis reuses the demo key instead of minting another.

Started with SIGINT ignored, as a shell starts a background job: the group's Ctrl-C must
still reach `up` itself, not only its worker and gateway (which then exit under it).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import re
import signal
import subprocess
import threading
import time

import pytest
import redis

from factories import add_byte_level_tokenizer, make_checkpoint
from runtime.embedded_redis import free_port
from runtime.stack import switchboard_command

pytestmark = pytest.mark.slow
BANNER_END = "Ctrl-C stops everything."


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_and_interrupt(command: list[str], env: dict[str, str]) -> str:
    """One `up` as `make run` starts it, stopped by Ctrl-C on its group; returns its output."""
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_ignore_sigint,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stdout])
    reader.start()
    output: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not any(BANNER_END in line for line in output):
            assert process.poll() is None, "".join(output)
            assert time.monotonic() < deadline, "no banner within 120 s:\n" + "".join(output)
            with contextlib.suppress(queue.Empty):
                output.append(lines.get(timeout=1))
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        assert process.wait(timeout=60) == 0, "".join(output)
        reader.join(timeout=10)
        while not lines.empty():
            output.append(lines.get())
        assert "stopping ..." in "".join(output)
        time.sleep(1)
        with pytest.raises(ProcessLookupError):  # nothing of the group is left running
            os.killpg(process.pid, 0)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return "".join(output)


def test_ctrl_c_stops_everything_and_restarts_keep_one_demo_key(redis_url, tmp_path):
    """Three starts on one Redis that outlives them: each stops cleanly on Ctrl-C, and all
    print the same working key, the demo tenant's only one."""
    model = add_byte_level_tokenizer(make_checkpoint(tmp_path / "model", vocab_size=512))
    # `up` uses the "sb:" prefix: a database of its own keeps it apart from other users.
    url = redis_url.rsplit("/", 1)[0] + "/14"
    env = {**os.environ, "SWITCHBOARD_REDIS_URL": url, "SWITCHBOARD_HOME": str(tmp_path)}
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        keys = []
        for _ in range(3):
            port = str(free_port())
            command = [*switchboard_command(), "up", "--model", str(model), "--port", port]
            banner = _start_and_interrupt(command, env)
            keys.append(re.search(r"API key \(tenant demo\):\s+(\S+)", banner).group(1))
        assert keys[0] == keys[1] == keys[2]
        assert client.scard("sb:tenant:demo:keys") == 1
        # The key is the one Redis knows (by its hash), not just the same string each time.
        assert client.get("sb:apikey:" + hashlib.sha256(keys[0].encode()).hexdigest())
    finally:
        stale = list(client.scan_iter("sb:*"))
        if stale:
            client.delete(*stale)
