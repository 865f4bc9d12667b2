"""Child processes of the gateway, started so that no fork handler runs in them.

The gateway shares its process with gRPC's threads, and gRPC core registers fork handlers:
a child forked while a call is in flight can crash in them before it execs (a SIGSEGV or a
failed check in the epoll poller: 30 of 1,600 spawns on a busy channel here). uvloop, the
gateway's loop, spawns with libuv, which forks. `subprocess.Popen` on Linux starts the child
with vfork, which runs no fork handlers, so children start here and join the loop afterwards:
their pipes as asyncio streams, their exit awaited on a pidfd (a thread elsewhere).

Each of our pipe ends is closed exactly once, by libuv, when its transport closes. uvloop's
pipe transport has libuv close the descriptor and then closes the file object it was given
too (expecting EBADF); a Popen file object would close the number a second time, and when
another thread (gRPC's) had opened a socket in between, that socket (a channel's connection
reset, or a call that never ends, in a test). So the pipes are made here (`os.pipe`), the
child's ends closed once after the spawn, and uvloop is given file objects that never close
their descriptor (``closefd=False``; asyncio's own loops close the file object instead).
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
        # (the child's end, ours) of each pipe; ours are not inherited (os.pipe's default)
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe() if stderr else (-1, -1)
        ours = [stdin_w, stdout_r] + ([stderr_r] if stderr else [])
        try:
            popen = subprocess.Popen(
                list(argv),
                stdin=stdin_r,
                stdout=stdout_w,
                stderr=stderr_w if stderr else subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            _close_all(ours)
            raise
        finally:
            _close_all([stdin_r, stdout_w] + ([stderr_w] if stderr else []))
        child = cls(popen)
        try:
            await child._join_loop(ours)
        except BaseException:
            popen.kill()
            popen.wait()
            child._close_pipes()
            _close_all(ours)  # those no transport took yet
            raise
        return child

    async def _join_loop(self, ours: list[int]) -> None:
        """``ours``: our ends, stdin's, stdout's (and stderr's); each leaves the list as a
        transport takes it (and with it the duty to close it)."""
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.connect_write_pipe(
            lambda: _WriteProtocol(loop), _pipe_file(loop, ours[0], "wb")
        )
        self._took(transport, ours)
        self.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        self.stdout = await self._reader(loop, ours)
        if ours:
            self.stderr = await self._reader(loop, ours)
        self._exited = _exit_future(loop, self._popen)

    async def _reader(
        self, loop: asyncio.AbstractEventLoop, ours: list[int]
    ) -> asyncio.StreamReader:
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), _pipe_file(loop, ours[0], "rb")
        )
        self._took(transport, ours)
        return reader

    def _took(self, transport: asyncio.BaseTransport, ours: list[int]) -> None:
        self._transports.append(transport)
        ours.pop(0)

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


def _pipe_file(loop: asyncio.AbstractEventLoop, fd: int, mode: str):
    """A file object over ``fd`` for a pipe transport of ``loop``, which closes ``fd`` once:
    under uvloop libuv closes the descriptor (the file object must not close it again);
    asyncio's own loops close the file object."""
    libuv_closes = type(loop).__module__.startswith("uvloop")
    return open(fd, mode, buffering=0, closefd=not libuv_closes)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)
    fds.clear()


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
