"""A request's grammar (a JSON schema, a regex, a Lark grammar…) checked before any worker
sees it: bounded in size, checked in child processes, remembered by content.

Checks run in long-lived `python -m gateway.structured.grammar_child` processes (see there why not
in the gateway: llguidance can overflow its stack on hostile grammars), one check at a time each.
Each child forks a fresh grandchild per check, so a grammar that crashes the compiler or runs past
`timeout_s` ends only its own check: no child has to be replaced, and nobody waits for one to start.

The children are shared fairly (`gateway.fair_slots.FairSlots`): a tenant runs at most
`per_tenant` checks at once and queues at most `queue_limit` more (past that, 429), and a freed
child goes to the waiting tenant that has used the children for the fewest seconds. A flood of
pathological grammars from one tenant thus costs that tenant's own turns; another tenant's check
waits at most for one check in progress.

Verdicts, good and bad, are kept in an LRU by sha256 of (tenant, format, text): a schema a tenant
sends again costs a hash and a dict lookup, and the same grammar checked by several of its
requests at once is checked once. The tenant is part of the key, as it salts the prefix cache:
otherwise a fast answer would tell a tenant that someone else had sent that schema recently.
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
from gateway.errors import HelperUnavailableError, InvalidRequestError
from gateway.fair_slots import FairSlots

log = logging.getLogger(__name__)

CHILD = [sys.executable, "-m", "gateway.structured.grammar_child"]
# What a child keeps of the gateway's environment: nothing secret reaches it.
INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")
# The child's own deadline is `timeout_s` per check; past this much more it is deemed stuck.
CHILD_GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    max_bytes: int  # a grammar's text, UTF-8
    cache_entries: int  # verdicts kept
    children: int  # checks running at once
    timeout_s: float  # one check, before its grandchild is killed
    per_tenant: int = 1  # checks one tenant runs at once
    queue_limit: int = 16  # checks one tenant may have waiting; past that, 429


class GrammarChecker:
    """Checks grammars for one gateway; `close` ends its children."""

    def __init__(self, limits: GrammarLimits) -> None:
        self.limits = limits
        self._verdicts: OrderedDict[bytes, str] = OrderedDict()  # key → error ("" valid)
        self._running: dict[bytes, asyncio.Task[str]] = {}
        self._slots = FairSlots(
            slots=limits.children,
            per_tenant=limits.per_tenant,
            queue_limit=limits.queue_limit,
            name="grammar checks",
        )
        self._idle: list[_Child] = []
        self._busy: set[_Child] = set()

    async def check(self, fmt: str, text: str, *, param: str, what: str, tenant: str) -> None:
        """A 400 naming ``param`` unless ``text`` is a valid grammar of format ``fmt``
        (``what`` names it in messages: "JSON schema", "regex"…), checked in ``tenant``'s
        turn."""
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.limits.max_bytes:
            metrics.GRAMMAR_CHECKS.labels(outcome="too_large").inc()
            raise InvalidRequestError(
                f"the {what} is {size} bytes; at most {self.limits.max_bytes} are allowed",
                param=param,
            )
        error = await self.verdict(fmt, text, tenant=tenant)
        if error:
            raise InvalidRequestError(f"invalid {what}: {error}", param=param)

    async def verdict(self, fmt: str, text: str, *, tenant: str) -> str:
        """Why the grammar is invalid ("" if it is valid), from the cache when known."""
        key = hashlib.sha256(f"{tenant}\0{fmt}\0{text}".encode("utf-8", "surrogatepass")).digest()
        known = self._verdicts.get(key)
        if known is not None:
            self._verdicts.move_to_end(key)
            metrics.GRAMMAR_CHECKS.labels(outcome="cached").inc()
            return known
        task = self._running.get(key)
        if task is None:
            # A task of its own: a check once started finishes (and is remembered) even if
            # every request waiting for it leaves.
            task = asyncio.ensure_future(self._check(fmt, text, tenant))
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

    async def _check(self, fmt: str, text: str, tenant: str) -> str:
        job = (json.dumps({"format": fmt, "text": text}) + "\n").encode()
        async with self._slots.hold(tenant):
            child = self._idle.pop() if self._idle else await _Child.start(self.limits.timeout_s)
            self._busy.add(child)
            try:
                async with asyncio.timeout(self.limits.timeout_s + CHILD_GRACE_S):
                    answer = await child.ask(job)
            except BaseException:
                await child.kill()
                raise
            finally:
                self._busy.discard(child)
            if answer is None:  # the child itself ended or got stuck: never a grammar's doing
                log.warning("a grammar check child ended (code %s)", child.returncode)
                await child.kill()
                raise HelperUnavailableError("the grammar checker failed; retry later")
            self._idle.append(child)
        error, outcome = answer
        metrics.GRAMMAR_CHECKS.labels(outcome=outcome).inc()
        if outcome == "crashed":
            log.info("a grammar crashed its check (tenant %s)", tenant)
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
    async def start(cls, timeout_s: float) -> _Child:
        env = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
        return cls(await Child.start([*CHILD, repr(timeout_s)], env=env, stderr=False))

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    async def ask(self, job: bytes) -> tuple[str, str] | None:
        """The child's (error, outcome) for one job; None if it ended instead of answering."""
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(job)
            await self.process.stdin.drain()
            line = await self.process.stdout.readline()
        except (BrokenPipeError, ConnectionResetError):
            return None
        if not line:
            return None
        answer = json.loads(line)
        return str(answer["error"]), str(answer["outcome"])

    async def kill(self) -> None:
        await self.process.kill()
