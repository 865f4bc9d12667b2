"""The worker's thread layout: the engine's step loop on the main thread, asyncio beside it,
and SIGTERM caught on the main thread reaching the RPC side."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from factories import make_checkpoint
from worker import LLMEngine, SamplingParams, engine_config
from worker.serving.async_engine import AsyncEngine
from worker.serving.main_thread import MainThreadEngineLoop


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return LLMEngine(
        make_checkpoint(tmp_path_factory.mktemp("ckpt")), engine_config(dtype="float32")
    )


def test_steps_run_on_the_main_thread_and_sigterm_reaches_the_rpc_loop(engine, monkeypatch):
    stepping_threads: set[str] = set()
    step = engine.step

    def recording_step():
        stepping_threads.add(threading.current_thread().name)
        return step()

    monkeypatch.setattr(engine, "step", recording_step)
    engine_loop = MainThreadEngineLoop()
    seen: dict = {}

    async def rpc_main() -> None:
        seen["rpc_thread"] = threading.current_thread().name
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        engine_loop.on_signal(lambda: loop.call_soon_threadsafe(stop.set))
        async_engine = AsyncEngine(engine)
        async_engine.start(engine_loop.runner)
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        outputs = [out async for out in async_engine.generate("r", [1, 2, 3], params)]
        seen["tokens"] = outputs[-1].output.token_ids
        os.kill(os.getpid(), signal.SIGTERM)  # handled on the main thread, in the step loop
        await asyncio.wait_for(stop.wait(), timeout=10)
        await async_engine.stop()

    before = signal.getsignal(signal.SIGTERM)
    engine_loop.run(functools.partial(asyncio.run, rpc_main()))
    assert stepping_threads == {threading.main_thread().name}
    assert seen["rpc_thread"] != threading.main_thread().name
    assert len(seen["tokens"]) == 5
    assert signal.getsignal(signal.SIGTERM) == before  # restored


def test_a_sigterm_the_kernel_gives_another_thread_still_stops_an_idle_worker(engine):
    """Linux may deliver a process's SIGTERM to any of its threads; CPython then runs the
    handler only when the main thread next wakes, and an idle step loop's wait would never
    end by itself."""
    engine_loop = MainThreadEngineLoop()
    waited: list[float] = []

    async def rpc_main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        engine_loop.on_signal(lambda: loop.call_soon_threadsafe(stop.set))
        async_engine = AsyncEngine(engine)
        async_engine.start(engine_loop.runner)
        await asyncio.sleep(0.2)  # the step loop is idle on the main thread now
        sent = time.monotonic()
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # to this thread
        try:
            await asyncio.wait_for(stop.wait(), timeout=10)
            waited.append(time.monotonic() - sent)
        finally:
            await async_engine.stop()  # wakes the step loop, whatever happened

    engine_loop.run(functools.partial(asyncio.run, rpc_main()))
    assert waited and waited[0] < 2.0


def test_an_rpc_side_failure_is_raised_on_the_main_thread():
    async def failing() -> None:
        raise OSError("port in use")

    with pytest.raises(OSError, match="port in use"):
        MainThreadEngineLoop().run(functools.partial(asyncio.run, failing()))


def test_run_refuses_other_threads():
    errors = []

    def call() -> None:
        try:
            MainThreadEngineLoop().run(lambda: None)
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]


def test_a_dying_step_loop_stops_the_rpc_side_and_is_raised():
    engine_loop = MainThreadEngineLoop()
    stopped = []

    def broken_step_loop() -> None:
        raise RuntimeError("engine bug")

    async def rpc_main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        engine_loop.on_signal(lambda: loop.call_soon_threadsafe(stop.set))
        engine_loop.runner(broken_step_loop)
        await asyncio.wait_for(stop.wait(), timeout=10)
        stopped.append(True)

    with pytest.raises(RuntimeError, match="engine bug"):
        engine_loop.run(functools.partial(asyncio.run, rpc_main()))
    assert stopped == [True]


STUCK_WORKER = """
import sys, time
from worker.serving.main_thread import MainThreadEngineLoop

def rpc_side_that_never_stops():
    print("up", flush=True)
    while True:
        time.sleep(0.05)

MainThreadEngineLoop(stop_deadline_s=float(sys.argv[1])).run(rpc_side_that_never_stops)
"""


def test_a_signalled_process_that_does_not_stop_dumps_its_stacks_and_exits(tmp_path):
    """The stop deadline: a shutdown that hangs past it ends the process with exit 1 and
    every thread's stack on stderr, naming where it hung."""
    process = subprocess.Popen(
        [sys.executable, "-c", STUCK_WORKER, "1.0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert process.stdout.readline() == b"up\n"
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
        took = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 1
    assert took >= 1.0
    assert "Timeout" in stderr.decode() and "rpc_side_that_never_stops" in stderr.decode()


def test_the_engine_is_built_on_the_thread_that_will_run_its_steps():
    """With a runner, WorkerServer builds its engine there (the main thread), so loading and
    the kernels' measurement start no OpenMP team on a pool thread
    (switchboard_kernels.openmp); a factory's error comes back to the event loop and the
    main thread goes on serving."""
    from worker.serving.server import WorkerServer

    engine_loop = MainThreadEngineLoop()
    built_on: list[str] = []

    def factory():
        built_on.append(threading.current_thread().name)
        return "an engine"

    def failing_factory():
        raise ValueError("no such checkpoint")

    async def rpc_main() -> None:
        server = WorkerServer(factory, model_name="m", engine_runner=engine_loop.runner)
        assert await server._build_engine() == "an engine"
        server._engine_factory = failing_factory
        with pytest.raises(ValueError, match="no such checkpoint"):
            await server._build_engine()
        server._engine_factory = factory
        assert await server._build_engine() == "an engine"

    engine_loop.run(functools.partial(asyncio.run, rpc_main()))
    assert built_on == [threading.main_thread().name] * 2
