"""A request's grammar (a JSON schema, a regex, a Lark grammar…) checked before any worker
sees it: bounded in size, checked in child processes, remembered by content.

Checks run in long-lived `python -m gateway.structured.grammar_child` processes (see there why not
in the gateway: llguidance can overflow its stack on hostile grammars), one check at a time each, so
a child that dies or runs past `timeout_s` takes only the grammar that did it with it, and is
replaced by the next check that needs one. Verdicts, good and bad, are kept in an LRU by sha256 of
(format, text): a schema sent again costs a hash and a dict lookup, and the same grammar checked by
several requests at once is checked once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass

from gateway import metrics
from gateway.child_processes import Child
from gateway.errors import InvalidRequestError

log = logging.getLogger(__name__)

CHILD = [sys.executable, "-m", "gateway.structured.grammar_child"]
# What a child keeps of the gateway's environment: nothing secret reaches it.
INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")
CRASHED = (
    "the grammar could not be compiled (the checker ended on it: it is nested too deeply "
    "or too large)"
)


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    max_bytes: int  # a grammar's text, UTF-8
    cache_entries: int  # verdicts kept
    children: int  # checks running at once
    timeout_s: float  # one check, before its child is killed


class GrammarChecker:
    """Checks grammars for one gateway; `close` ends its children."""

    def __init__(self, limits: GrammarLimits) -> None:
        self.limits = limits
        self._verdicts: OrderedDict[bytes, str] = OrderedDict()  # key → error ("" valid)
        self._running: dict[bytes, asyncio.Task[str]] = {}
        self._slots = asyncio.Semaphore(limits.children)
        self._idle: list[_Child] = []
        self._busy: set[_Child] = set()

    async def check(self, fmt: str, text: str, *, param: str, what: str) -> None:
        """A 400 naming ``param`` unless ``text`` is a valid grammar of format ``fmt``
        (``what`` names it in messages: "JSON schema", "regex"…)."""
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.limits.max_bytes:
            metrics.GRAMMAR_CHECKS.labels(outcome="too_large").inc()
            raise InvalidRequestError(
                f"the {what} is {size} bytes; at most {self.limits.max_bytes} are allowed",
                param=param,
            )
        error = await self.verdict(fmt, text)
        if error:
            raise InvalidRequestError(f"invalid {what}: {error}", param=param)

    async def verdict(self, fmt: str, text: str) -> str:
        """Why the grammar is invalid ("" if it is valid), from the cache when known."""
        key = hashlib.sha256(f"{fmt}\0{text}".encode("utf-8", "surrogatepass")).digest()
        known = self._verdicts.get(key)
        if known is not None:
            self._verdicts.move_to_end(key)
            metrics.GRAMMAR_CHECKS.labels(outcome="cached").inc()
            return known
        task = self._running.get(key)
        if task is None:
            # A task of its own: a check once started finishes (and is remembered) even if
            # every request waiting for it leaves.
            task = asyncio.ensure_future(self._check(fmt, text))
            self._running[key] = task
            task.add_done_callback(lambda done: self._remember(key, done))
        return await asyncio.shield(task)

    def _remember(self, key: bytes, task: asyncio.Task[str]) -> None:
        self._running.pop(key, None)
        if task.cancelled() or task.exception() is not None:
            return
        self._verdicts[key] = task.result()
        while len(self._verdicts) > self.limits.cache_entries:
            self._verdicts.popitem(last=False)

    async def _check(self, fmt: str, text: str) -> str:
        job = (json.dumps({"format": fmt, "text": text}) + "\n").encode()
        async with self._slots:
            child = self._idle.pop() if self._idle else await _Child.start()
            self._busy.add(child)
            try:
                async with asyncio.timeout(self.limits.timeout_s):
                    error = await child.ask(job)
            except TimeoutError:
                await child.kill()
                metrics.GRAMMAR_CHECKS.labels(outcome="timeout").inc()
                return f"checking it took longer than {self.limits.timeout_s:g} s"
            except BaseException:
                await child.kill()
                raise
            finally:
                self._busy.discard(child)
            if error is None:
                log.warning("a grammar check child ended (code %s)", child.returncode)
                await child.kill()
                metrics.GRAMMAR_CHECKS.labels(outcome="crashed").inc()
                return CRASHED
            self._idle.append(child)
        metrics.GRAMMAR_CHECKS.labels(outcome="invalid" if error else "valid").inc()
        return error

    async def close(self) -> None:
        for task in list(self._running.values()):
            task.cancel()
        children = [*self._idle, *self._busy]
        self._idle.clear()
        for child in children:
            await child.kill()


class _Child:
    """One `gateway.structured.grammar_child` process: a line in, a line out."""

    def __init__(self, process: Child) -> None:
        self.process = process

    @classmethod
    async def start(cls) -> _Child:
        env = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
        return cls(await Child.start(CHILD, env=env, stderr=False))

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    async def ask(self, job: bytes) -> str | None:
        """The child's verdict on one job; None if it ended instead of answering."""
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(job)
            await self.process.stdin.drain()
            line = await self.process.stdout.readline()
        except (BrokenPipeError, ConnectionResetError):
            return None
        if not line:
            return None
        return str(json.loads(line)["error"])

    async def kill(self) -> None:
        await self.process.kill()
