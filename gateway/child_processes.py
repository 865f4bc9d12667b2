"""Child processes of the gateway, started so that no fork handler runs in them.

The gateway shares its process with gRPC's threads, and gRPC core registers fork handlers:
a child forked while a call is in flight can crash in them before it execs (a SIGSEGV or a
failed check in the epoll poller: 30 of 1,600 spawns on a busy channel here). uvloop, the
gateway's loop, spawns with libuv, which forks. `subprocess.Popen` on Linux starts the child
with vfork, which runs no fork handlers, so children start here and join the loop afterwards:
their pipes as asyncio streams, their exit awaited on a pidfd (a thread elsewhere).

Each pipe is closed through its transport, which closes Popen's file object with it, so its
descriptor is closed exactly once. A transport freed unclosed under uvloop has libuv close
the descriptor while the file object still holds the number; the file object then closed it
a second time when it was collected, by then another socket's (a gRPC channel's, in a test).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Sequence


class Child:
    """One running child: ``stdin``, ``stdout`` (and ``stderr`` if asked for) as streams."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self._popen = popen
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._exited: asyncio.Future[int] | None = None
        self._transports: list[asyncio.BaseTransport] = []

    @classmethod
    async def start(cls, argv: Sequence[str], *, env: dict[str, str], stderr: bool) -> Child:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if stderr else subprocess.DEVNULL,
            env=env,
        )
        child = cls(popen)
        try:
            await child._join_loop()
        except BaseException:
            popen.kill()
            popen.wait()
            child._close_pipes()
            raise
        return child

    async def _join_loop(self) -> None:
        loop = asyncio.get_running_loop()
        popen = self._popen
        assert popen.stdin is not None and popen.stdout is not None
        transport, protocol = await loop.connect_write_pipe(
            lambda: _WriteProtocol(loop), popen.stdin
        )
        self._transports.append(transport)
        self.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        self.stdout = await self._reader(loop, popen.stdout)
        if popen.stderr is not None:
            self.stderr = await self._reader(loop, popen.stderr)
        self._exited = _exit_future(loop, popen)

    async def _reader(self, loop: asyncio.AbstractEventLoop, pipe) -> asyncio.StreamReader:
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe
        )
        self._transports.append(transport)
        return reader

    def _close_pipes(self) -> None:
        """Our ends of the pipes, each closed once, through its transport (module docstring)."""
        for transport in self._transports:
            transport.close()
        self._transports.clear()

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    async def wait(self) -> int:
        assert self._exited is not None
        return await asyncio.shield(self._exited)

    async def communicate(self, data: bytes) -> tuple[bytes, bytes]:
        """Write ``data``, close stdin, and read both outputs to their end; then reap."""
        assert self.stdin is not None and self.stdout is not None
        self.stdin.write(data)
        await self.stdin.drain()
        self.stdin.close()
        out, err = await asyncio.gather(
            self.stdout.read(), self.stderr.read() if self.stderr else _nothing()
        )
        await self.wait()
        self._close_pipes()
        return out, err

    async def kill(self) -> None:
        """Kill the child unless it has ended already, and reap it."""
        with contextlib.suppress(ProcessLookupError):
            if self._popen.returncode is None:
                self._popen.kill()
        await self.wait()
        self._close_pipes()


class _WriteProtocol(asyncio.streams.FlowControlMixin):
    """What a StreamWriter on a pipe needs: flow control, and nothing read back."""


async def _nothing() -> bytes:
    return b""


def _exit_future(loop: asyncio.AbstractEventLoop, popen: subprocess.Popen) -> asyncio.Future:
    """A future resolved with the exit code once the child ends (it is reaped then)."""
    if not hasattr(os, "pidfd_open"):  # not Linux: a thread waits instead
        return asyncio.ensure_future(loop.run_in_executor(None, popen.wait))
    exited: asyncio.Future[int] = loop.create_future()
    pidfd = os.pidfd_open(popen.pid)

    def reap() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        if not exited.done():
            exited.set_result(popen.wait())

    loop.add_reader(pidfd, reap)
    return exited
