"""The thread that owns an ``LLMEngine``: it runs commands and steps, and hands every step's
outputs to an asyncio event loop.

Only this thread touches the engine. Other threads post commands (add, abort, load an
adapter) to a queue that the loop drains between steps; ``call`` awaits a command's result
from the event loop. Each step's outputs cross back with ``call_soon_threadsafe``. The loop
sleeps on a condition variable while there is neither work nor a command, so an idle worker
burns no CPU; torch releases the GIL inside its ops, so the event loop keeps serving RPCs
while a forward pass runs.

Which thread runs the loop matters on CPU: torch's OpenMP runtime (libgomp) keeps a hot
thread team only for parallel regions started from the process's initial thread, and a
region started from any other thread pays a start-up cost on every op (see
docs/engine.md#threads). ``start(runner=...)`` hands the loop to a thread of the caller's
choosing; the worker process gives it its main thread (``worker.serving.main_thread``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from worker.core.outputs import RequestOutput
from worker.engine.engine_stats import EngineStats, snapshot
from worker.engine.llm_engine import LLMEngine
from worker.serving.main_thread import IDLE_WAKE_S

logger = logging.getLogger(__name__)

OutputsHandler = Callable[[list[RequestOutput]], None]
ErrorHandler = Callable[[list[str], BaseException], None]


class EngineStoppedError(RuntimeError):
    """The engine loop is not running (not started yet, or stopped)."""


class EngineLoop:
    """Runs ``engine`` on one thread; ``on_outputs`` and ``on_error`` run on the event loop
    given to ``start`` with each step's outputs, or the engine ids a failure ended."""

    def __init__(
        self, engine: LLMEngine, *, on_outputs: OutputsHandler, on_error: ErrorHandler
    ) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_error = on_error
        self._commands: deque[Callable[[], None]] = deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        self.running = False
        self._finished = threading.Event()  # set when the step loop returns
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats = snapshot(engine)

    @property
    def stats(self) -> EngineStats:
        """The latest snapshot; safe to read from any thread."""
        return self._stats

    def start(self, runner: Callable[[Callable[[], None]], None] | None = None) -> None:
        """Start the loop; outputs go to the event loop this is called from. ``runner``
        receives the loop function and must run it soon on some thread (the worker's main
        thread); by default the loop gets a thread of its own."""
        if self.running:
            raise RuntimeError("the engine loop is already running")
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self.running = True
        self._finished.clear()
        if runner is None:
            threading.Thread(target=self._run_loop, name="engine-loop", daemon=True).start()
        else:
            runner(self._run_loop)

    async def stop(self) -> None:
        """Abort what the engine still holds, end the loop and wait for it."""
        if not self.running:
            return
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        await asyncio.to_thread(self._finished.wait)
        self.running = False

    def post(self, command: Callable[[], None]) -> None:
        """Queue ``command`` to run on the loop thread before its next step."""
        with self._wakeup:
            self._commands.append(command)
            self._wakeup.notify()

    async def call(self, fn: Callable[..., Any], *args: Any, stop_batch_step: bool = False) -> Any:
        """Run ``fn(*args)`` on the loop thread; its result or exception comes back here.
        ``stop_batch_step``: interactive work: a step of batch work alone in flight stops at
        its next layer (``LLMEngine.stop_batch_step``), so ``fn`` runs now, not after it."""
        if not self.running or self._loop is None:
            raise EngineStoppedError("the engine loop is not running")
        future = self._loop.create_future()

        def command() -> None:
            try:
                result = fn(*args)
            except Exception as exc:
                self._to_event_loop(settle_future, future, None, exc)
            else:
                # Publish the effect (an adapter loaded, a request queued) before the caller
                # resumes, so a Stats call right after it sees it.
                self._stats = snapshot(self.engine)
                self._to_event_loop(settle_future, future, result, None)

        self.post(command)
        if stop_batch_step:  # after the post: the loop's next turn finds the command
            self.engine.stop_batch_step()
        return await future

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """From the loop thread: hand ``outputs`` to the event loop."""
        if outputs:
            self._to_event_loop(self._on_outputs, outputs)

    def abort_on_loop(self, engine_ids: list[str]) -> None:
        """From the loop thread: abort ``engine_ids`` and deliver their last outputs."""
        self.deliver([out for i in engine_ids if (out := self.engine.abort(i)) is not None])

    def _run_loop(self) -> None:
        try:
            self._run()
        finally:
            self._finished.set()

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._wakeup:
                while not (self._commands or engine.has_unfinished_requests or self._stopping):
                    self._wakeup.wait(IDLE_WAKE_S)  # see IDLE_WAKE_S: signals
                commands = list(self._commands)
                self._commands.clear()
                stopping = self._stopping
            for command in commands:
                try:
                    command()
                except Exception:  # a bug: log it, keep serving everyone else
                    logger.exception("engine command failed")
            if stopping:
                self.abort_on_loop(list(engine.requests))
                self._stats = snapshot(engine)
                return
            if engine.has_unfinished_requests:
                self._step()
            else:
                self._stats = snapshot(engine)

    def _step(self) -> None:
        """One engine step. The stats snapshot is taken before results are delivered, so a
        caller that sees its request finish also sees the blocks it freed. A request that
        failed the step alone gets its error instead of its last output."""
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # The engine isolates what a request's values break (worker.engine.isolation); a
            # step that still raises (the scheduler's own bug) would fail again with the same
            # batch: end every request with the error rather than leave it waiting forever.
            logger.exception("engine step failed; aborting %d requests", len(self.engine.requests))
            failed = list(self.engine.requests)
            for engine_id in failed:
                self.engine.abort(engine_id)
            self._stats = snapshot(self.engine)
            self._to_event_loop(self._on_error, failed, exc)
            return
        self._stats = snapshot(self.engine)
        failures = self.engine.take_failures()
        self.deliver([out for out in outputs if out.request_id not in failures])
        for engine_id, error in failures.items():
            self._to_event_loop(self._on_error, [engine_id], error)

    def _to_event_loop(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to serve
            logger.warning("the event loop closed under a running engine; stopping the loop")
            self._stopping = True


def settle_future(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
