"""gateway.child_processes: children start, talk and end on the gateway's loop (uvloop), and
a child started while gRPC calls are in flight in the same process runs its program.

The second is what broke: uvloop's spawn forks, gRPC's fork handlers then ran in the child
and crashed it now and then (about 2% of spawns on a busy channel) before it could exec."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.child_processes import Child


def test_a_child_echoes_its_input_and_reports_its_exit_code() -> None:
    async def main() -> None:
        cat = await Child.start(["cat"], env={}, stderr=True)
        assert await cat.communicate(b"hello\n") == (b"hello\n", b"")
        assert cat.returncode == 0
        script = "import sys; sys.stderr.write('bye'); sys.exit(3)"
        failing = await Child.start([sys.executable, "-c", script], env={}, stderr=True)
        assert await failing.communicate(b"") == (b"", b"bye")
        assert failing.returncode == 3

    uvloop.run(main())


def test_kill_ends_a_child_that_never_reads_and_reaps_it() -> None:
    async def main() -> None:
        sleeper = await Child.start(["sleep", "60"], env={}, stderr=False)
        await sleeper.kill()
        assert sleeper.returncode == -signal.SIGKILL
        await sleeper.kill()  # a second kill of an ended child is harmless

    uvloop.run(asyncio.wait_for(main(), 10))


def test_children_started_while_grpc_calls_are_in_flight_all_run() -> None:
    async def main() -> list[tuple[int | None, bytes]]:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = health_pb2_grpc.HealthStub(channel)
        busy = True

        async def call_forever() -> None:
            while busy:
                await stub.Check(health_pb2.HealthCheckRequest())

        async def echo(i: int) -> tuple[int | None, bytes]:
            child = await Child.start(["cat"], env={}, stderr=True)
            out, _ = await child.communicate(b"%d" % i)
            return child.returncode, out

        callers = [asyncio.create_task(call_forever()) for _ in range(8)]
        answers = []
        for first in range(0, 400, 4):
            answers += await asyncio.gather(*(echo(i) for i in range(first, first + 4)))
        busy = False
        await asyncio.gather(*callers)
        await channel.close()
        await server.stop(None)
        return answers

    answers = uvloop.run(main())
    assert answers == [(0, b"%d" % i) for i in range(400)]


def test_a_finished_child_never_closes_a_descriptor_that_has_been_reused() -> None:
    """A pipe's descriptor is closed once: after the child is dropped, the numbers it used go to
    new files, and collecting the child's Popen afterwards must leave those files open (it closed
    them a second time, another socket's by then, when libuv had closed the pipes itself)."""

    async def main() -> None:
        talked = await Child.start(["cat"], env={}, stderr=True)
        await talked.communicate(b"x")
        killed = await Child.start(["sleep", "60"], env={}, stderr=True)
        await killed.kill()
        popens = [talked._popen, killed._popen]
        await asyncio.sleep(0.05)  # a transport closes its pipe on the loop's next turns
        # The pipes are the transports' alone: no file object of Popen's holds their numbers.
        assert all(f is None for p in popens for f in (p.stdin, p.stdout, p.stderr))
        del talked, killed
        gc.collect()
        # Files that take the lowest free numbers: the pipes' old ones, if they were freed.
        reused = [os.open(os.devnull, os.O_RDONLY) for _ in range(8)]
        try:
            popens.clear()
            gc.collect()
            for fd in reused:
                os.fstat(fd)  # EBADF if a pipe's file object closed it
        finally:
            for fd in reused:
                os.close(fd)

    uvloop.run(main())
