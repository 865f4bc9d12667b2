"""The worker process's threads: the engine's step loop on the main thread, RPC beside it.

Why the main thread: see ``worker.serving.engine_loop`` (OpenMP parallel regions started from
any other thread pay a start-up cost each on CPU). The gRPC server's asyncio loop runs on a second
thread, and asks for the step loop to be run here through ``runner``. Signals are
delivered to the main thread only, so SIGTERM/SIGINT are caught here and passed on to the
RPC side's ``on_signal`` callback.
"""

from __future__ import annotations

import contextlib
import faulthandler
import queue
import signal
import threading
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The main thread never waits longer than this at a time, idle or not (the step loop's wait
# too): CPython runs signal handlers on the main thread only, and a thread blocked in a
# lock wait is not woken when the kernel delivers SIGTERM to another of the process's
# threads. The handler runs when it next wakes.
IDLE_WAKE_S = 0.5


class MainThreadEngineLoop:
    def __init__(self, *, stop_deadline_s: float | None = None) -> None:
        """``stop_deadline_s``: after the first stop signal the process has this long to
        exit; past it, every thread's stack goes to stderr and the process exits 1, so a
        shutdown that hangs (a drain, a library's thread at exit) says where and ends."""
        self._stop_deadline_s = stop_deadline_s
        # queue.Queue, not SimpleQueue: its get() waits in an interruptible lock acquire,
        # so a signal during model loading runs its handler at once.
        self._work: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._on_signal: Callable[[], None] | None = None
        self._signalled = False

    def runner(self, loop_function: Callable[[], None]) -> None:
        """For ``AsyncEngine.start``: run the step loop on the main thread (any thread)."""
        self._work.put(loop_function)

    def on_signal(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the main thread) on SIGTERM or SIGINT, or now if one came."""
        self._on_signal = callback
        if self._signalled:
            callback()

    def run(self, rpc_main: Callable[[], None]) -> None:
        """On the main thread: ``rpc_main`` on a second thread, the step loop(s) it hands over
        here, until ``rpc_main`` returns (its exception, if any, is raised here)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("MainThreadEngineLoop.run must be called on the main thread")
        failure: list[BaseException] = []

        def rpc_thread() -> None:
            try:
                rpc_main()
            except BaseException as exc:  # re-raised on the main thread below
                failure.append(exc)
            finally:
                self._work.put(None)

        previous = {sig: signal.signal(sig, self._handle_signal) for sig in STOP_SIGNALS}
        thread = threading.Thread(target=rpc_thread, name="rpc-loop")
        thread.start()
        try:
            try:
                while (work := self._next_work()) is not None:
                    work()
            except BaseException:
                # The step loop died (a bug): stop the RPC side as SIGTERM would, so the
                # process exits and gets restarted instead of serving with no engine.
                self._tell_rpc_side()
                thread.join()
                raise
            thread.join()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if failure:
            raise failure[0]

    def _next_work(self) -> Callable[[], None] | None:
        # Bounded waits: see IDLE_WAKE_S.
        while True:
            try:
                return self._work.get(timeout=IDLE_WAKE_S)
            except queue.Empty:
                continue

    def _handle_signal(self, signum: int, frame: object) -> None:
        if not self._signalled and self._stop_deadline_s is not None:
            # A C thread of faulthandler's: it fires even if this interpreter is stuck.
            faulthandler.dump_traceback_later(self._stop_deadline_s, exit=True)
        self._signalled = True
        self._tell_rpc_side()

    def _tell_rpc_side(self) -> None:
        if self._on_signal is None:
            return
        # RuntimeError: the RPC side's loop is closed, so it has stopped already.
        with contextlib.suppress(RuntimeError):
            self._on_signal()
