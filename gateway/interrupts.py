"""Cut a task's await short when some other future ends: a client leaving, a quota refusal.

asyncio has no "wait for this, unless that happens first" that keeps the work on the
caller's own task (``asyncio.wait`` needs a task per side, and the hops between them show
in every request's latency under load: docs/performance.md); this cancels the caller
instead and tells that cancellation apart from any other, so the caller can raise what
actually happened.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Interrupt:
    """``with Interrupt(future, fires) as it:`` — while inside, if ``future`` ends (not
    cancelled) in a way ``fires`` accepts, the task that entered is cancelled and
    ``it.fired`` is set; the block then sees a CancelledError, which the caller's
    ``except`` turns into its own error (the task's cancel request is withdrawn)."""

    def __init__(self, future: asyncio.Future, fires: Callable[[asyncio.Future], bool]):
        self.future = future
        self.fires = fires
        self.fired = False
        self._task: asyncio.Task | None = None

    def __enter__(self) -> Interrupt:
        self._task = asyncio.current_task()
        assert self._task is not None
        self.future.add_done_callback(self._on_done)
        return self

    def _on_done(self, future: asyncio.Future) -> None:
        if self._task is not None and not future.cancelled() and self.fires(future):
            self.fired = True
            self._task.cancel()

    def __exit__(self, exc_type, exc, traceback) -> None:
        task, self._task = self._task, None
        self.future.remove_done_callback(self._on_done)
        if self.fired and exc_type is asyncio.CancelledError and task is not None:
            task.uncancel()
