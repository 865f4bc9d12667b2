"""The engine behind a server: asyncio in front of the engine's own thread
(``worker.serving.engine_loop``).

Each request's samples stream through an ``asyncio.Queue``; the loop thread's outputs are
routed to them by engine request id. What each sample generated is counted here, read or
not, so an ``Abort`` can report what a departed caller owes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from adapters.errors import AdapterError, AdapterNotFoundError
from worker.core.outputs import RequestOutput
from worker.core.sequence import Band
from worker.engine.engine_stats import EngineStats
from worker.engine.llm_engine import LLMEngine
from worker.errors import InvalidRequestError
from worker.sampling.sampling_params import MAX_N, SamplingParams
from worker.serving.engine_loop import EngineLoop

logger = logging.getLogger(__name__)

# Ended requests whose costs stay known, for an Abort that arrives
# just after the call it follows was cancelled or finished.
ENDED_KEPT = 1024


class AdapterMismatchError(AdapterError):
    """The files at the given path hold another adapter than the requested content id."""


@dataclass(slots=True)
class SampleOutput:
    """One step's delta for sample ``index`` of a request (``n`` samples: index 0..n-1)."""

    index: int
    output: RequestOutput


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue  # of RequestOutput or BaseException
    index: int
    engine_id: str = ""
    tenant: str | None = None
    # What the sample cost so far, whether its consumer read it or not (``abort_counted``).
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    final_only: bool = False  # the consumer waits for the whole answer (``generate``)

    def note(self, out: RequestOutput) -> None:
        """Count ``out``'s tokens (counts only grow: deliveries may arrive out of order)."""
        self.completion_tokens = max(self.completion_tokens, out.num_tokens)
        self.cached_tokens = max(self.cached_tokens, out.num_cached_tokens)


@dataclass(frozen=True, slots=True)
class RequestCost:
    """What one request consumed: its prompt, and every sample's generated tokens together."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class AsyncEngine:
    """``start()`` in a running event loop, then ``generate``/``abort`` from it; ``stop()``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._thread = EngineLoop(engine, on_outputs=self._route, on_error=self._route_error)
        # Event-loop side only: engine request id -> its stream; request id -> engine ids.
        self._streams: dict[str, _Stream] = {}
        self._requests: dict[str, list[str]] = {}
        self._ended: OrderedDict[str, list[_Stream]] = OrderedDict()  # request id -> streams
        # Adapter loads in progress, by content id: a second caller (a request arriving
        # while the gateway's preload runs) waits for the first instead of reading again.
        self._loading: dict[str, asyncio.Future] = {}
        self._post = self._thread.post
        self._call = self._thread.call

    # --- lifecycle ----------------------------------------------------------------------

    def start(self, runner: Callable[[Callable[[], None]], None] | None = None) -> None:
        """Start the step loop (`EngineLoop.start`); outputs go to this event loop."""
        self._thread.start(runner)

    async def warm_up(self) -> None:
        """The engine's warm-up (`LLMEngine.warm_up`), on the loop thread: the thread whose
        OpenMP team will run the steps."""
        await self._call(self.engine.warm_up)

    async def stop(self) -> None:
        """Abort whatever is left, stop the step loop and wait for it."""
        if not self._thread.running:
            return
        self.abort_all()
        await self._thread.stop()

    @property
    def stats(self) -> EngineStats:
        """The latest snapshot; safe to read from any thread."""
        return self._thread.stats

    @property
    def num_requests(self) -> int:
        """Requests (not samples) with a stream open."""
        return len(self._requests)

    # --- requests -----------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        adapter_id: str | None = None,
        adapter_path: str | Path | None = None,
        mix: list[tuple[str, float]] | None = None,
        n: int = 1,
        tenant: str | None = None,
        tenant_weight: float = 1.0,
        band: Band = Band.INTERACTIVE,
        final_only: bool = False,
    ) -> AsyncIterator[SampleOutput]:
        """Stream the deltas of ``n`` samples of one prompt, merged, until all have finished.

        ``n > 1`` runs n engine requests ``f"{request_id}-{i}"`` (every request uses that
        naming); with a seed, sample i uses ``seed + i`` so the samples differ yet are
        reproducible. The prompt is computed once; the samples then share its KV blocks
        (copy-on-write). ``adapter_path`` loads the adapter first if it is not loaded;
        ``mix`` names loaded adapters (content ids) with weights instead of ``adapter_id``;
        ``tenant`` isolates the prefix cache and is served its share (``tenant_weight``) under
        fair scheduling. Invalid requests raise here, before any output.
        Closing the iterator early (or cancelling its consumer) aborts what is left.
        ``final_only``: each sample's last output alone (its lists whole: ``token_ids``,
        ``text``, ``logprobs``), for a caller that waits for the whole answer; it is then
        woken once a sample instead of once a step (a batch line's 32 tokens cost the event
        loop 32 wake-ups and deltas, on the cores the engine computes on).
        """
        received = time.monotonic()  # the engine's clocks for this request start here
        if not 1 <= n <= MAX_N:
            raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {n}")
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        engine_ids = [f"{request_id}-{i}" for i in range(n)]
        queue: asyncio.Queue = asyncio.Queue()
        self._requests[request_id] = engine_ids
        streams = [
            _Stream(queue, i, engine_id, tenant, len(prompt_token_ids), final_only=final_only)
            for i, engine_id in enumerate(engine_ids)
        ]
        self._streams.update(zip(engine_ids, streams, strict=True))
        unfinished = set(engine_ids)
        try:
            if adapter_id is not None and adapter_path and not self._has_adapter(adapter_id):
                await self.load_adapter(adapter_id, adapter_path)
            if params.structured_output is not None:  # compiled here, off the step loop
                await asyncio.to_thread(
                    self.engine.grammars.prepare, params.structured_output, tenant or ""
                )
            await self._call(
                self._add_on_loop,
                engine_ids,
                prompt_token_ids,
                params,
                adapter_id,
                mix,
                tenant,
                tenant_weight,
                received,
                band,
                stop_batch_step=band is Band.INTERACTIVE,
            )
            while unfinished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                stream = self._streams[item.request_id]
                if item.finished:
                    unfinished.discard(item.request_id)
                yield SampleOutput(stream.index, item)
        finally:
            if unfinished:
                leftover = [s for s in streams if s.engine_id in unfinished]
                self._post(lambda: self._abort_counted_on_loop(leftover))
            for engine_id in engine_ids:
                self._streams.pop(engine_id, None)
            self._requests.pop(request_id, None)
            while not queue.empty():  # outputs nobody will read; the ledger keeps counts only
                queue.get_nowait()
            self._ended[request_id] = streams
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; its stream ends with ``"abort"``."""
        engine_ids = self._requests.get(request_id)
        if engine_ids:
            self._post(lambda: self._thread.abort_on_loop(engine_ids))

    async def abort_counted(self, request_id: str, *, tenant: str | None) -> RequestCost | None:
        """Abort a request if it still runs, and report what it cost: its prompt and every
        token its samples generated, read by anyone or not (the gateway charges it). Known
        while it runs and for the last ``ENDED_KEPT`` ended requests; None otherwise, or
        when ``tenant`` is not the request's own."""
        ids = self._requests.get(request_id)
        streams = [self._streams[i] for i in ids] if ids else self._ended.get(request_id)
        if not streams or streams[0].tenant != tenant:
            return None
        # On the loop thread, after any abort already posted: the counts are final then.
        await self._call(self._abort_counted_on_loop, streams)
        return RequestCost(
            prompt_tokens=streams[0].prompt_tokens,
            completion_tokens=sum(s.completion_tokens for s in streams),
            cached_tokens=max(s.cached_tokens for s in streams),
        )

    def abort_all(self) -> None:
        """Abort every open request (the end of a drain deadline, or stop)."""
        for request_id in list(self._requests):
            self.abort(request_id)

    # --- adapters -----------------------------------------------------------------------

    async def load_adapter(self, adapter_id: str, path: str | Path) -> str:
        """Load the adapter with content id ``adapter_id`` from ``path``, unless loaded.

        Reading and validating the files (tens of ms for a large adapter) happens in a
        worker thread, so the step loop keeps decoding meanwhile; only naming it runs on
        the loop."""
        manager = self.engine.lora_manager
        if manager is None or self._has_adapter(adapter_id) or not Path(path).exists():
            await self._call(self._load_on_loop, adapter_id, path)  # its errors, on the loop
            return adapter_id
        loading = self._loading.get(adapter_id)
        if loading is None:
            loading = asyncio.ensure_future(self._read_and_add(adapter_id, path))
            self._loading[adapter_id] = loading
            loading.add_done_callback(lambda _: self._loading.pop(adapter_id, None))
        await asyncio.shield(loading)
        return adapter_id

    async def _read_and_add(self, adapter_id: str, path: str | Path) -> None:
        manager = self.engine.lora_manager
        assert manager is not None
        adapter = await asyncio.to_thread(manager.read, path)
        if adapter.id != adapter_id:
            raise AdapterMismatchError(
                f"the adapter at {path} has content id {adapter.id}, not {adapter_id}"
            )
        await self._call(self.engine.add_adapter, adapter_id, adapter, path)

    def _has_adapter(self, adapter_id: str) -> bool:
        manager = self.engine.lora_manager
        return manager is not None and adapter_id in manager.names

    async def unload_adapter(self, adapter_id: str) -> None:
        await self._call(self.engine.unload_adapter, adapter_id)

    # --- on the loop thread ------------------------------------------------------------

    def _add_on_loop(
        self,
        engine_ids: list[str],
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter_id: str | None,
        mix: list[tuple[str, float]] | None,
        tenant: str | None,
        tenant_weight: float,
        received: float,
        band: Band,
    ) -> None:
        per_sample = [
            dataclasses.replace(params, seed=params.seed + i) if params.seed is not None else params
            for i in range(len(engine_ids))
        ]
        self.engine.add_samples(
            engine_ids,
            prompt_token_ids,
            per_sample,
            adapter=adapter_id,
            mix=mix,
            tenant=tenant,
            tenant_weight=tenant_weight,
            arrival_time=received,
            band=band,
        )

    def _load_on_loop(self, adapter_id: str, path: str | Path) -> None:
        if self.engine.lora_manager is not None and adapter_id in self.engine.lora_manager.names:
            return
        if not Path(path).exists():
            raise AdapterNotFoundError(f"no adapter files at {path}")
        loaded = self.engine.load_adapter(adapter_id, path)
        if loaded != adapter_id:
            self.engine.unload_adapter(adapter_id)
            raise AdapterMismatchError(
                f"the adapter at {path} has content id {loaded}, not {adapter_id}"
            )

    def _abort_counted_on_loop(self, streams: list[_Stream]) -> None:
        """Abort what of ``streams`` still runs; each counts its final output first."""
        aborted = []
        for stream in streams:
            out = self.engine.abort(stream.engine_id)
            if out is not None:
                stream.note(out)
                aborted.append(out)
        self._thread.deliver(aborted)

    # --- on the event loop -------------------------------------------------------------

    def _route(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:  # None: the consumer is gone already
                stream.note(out)
                if out.finished or not stream.final_only:
                    stream.queue.put_nowait(out)

    def _route_error(self, engine_ids: list[str], exc: BaseException) -> None:
        queues = {id(s.queue): s.queue for i in engine_ids if (s := self._streams.get(i))}
        for queue in queues.values():
            queue.put_nowait(exc)
