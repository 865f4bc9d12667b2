"""After sampling, for the whole step: tokens into requests, requests into outputs, and the
ends of requests.

Each sampled token is appended, detokenized and checked (``TokenProcessor``, per sequence);
each request
that produced a token or ended gets a ``RequestOutput``; a request that finished, failed
alone or was aborted leaves the schedule, its forks and the speculator here. Postprocessing
that raises fails its own request only (``isolating``), as a forward pass or sampling does
in ``worker.engine.isolation``.

With ``async_output`` this is split in two: ``commit`` does at once what the next step
needs (the token appended; an end by a stop token, the length or the grammar), and
``render_committed`` the rest (detokenizing, stop strings, the outputs) in the next step,
while the device runs its forward pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from worker.core.forks import PendingForks
from worker.core.outputs import RequestOutput
from worker.core.scheduler import Scheduler
from worker.core.sequence import FinishReason, Sequence, SequenceStatus
from worker.engine.token_processor import TokenProcessor
from worker.errors import EngineError, SequenceFailedError, StructuredOutputError
from worker.model.slot_eviction import SlotEviction
from worker.sampling.rows import SampledToken, SamplingRow
from worker.spec_decode.speculator import Speculator

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A request that failed this step, and why.
Failed = list[tuple[Sequence, EngineError]]


class OutputStage:
    """The engine's last stage; ``requests`` and ``rows`` are the engine's own tables of
    running requests (by request id), from which ended requests are removed here."""

    def __init__(
        self,
        tokens: TokenProcessor,
        scheduler: Scheduler,
        forks: PendingForks,
        speculator: Speculator | None,
        requests: dict[str, Sequence],
        rows: dict[str, SamplingRow],
        *,
        eviction: SlotEviction | None = None,
    ) -> None:
        """``eviction``: the adapter slots' rule, told when a sequence with adapters ends."""
        self.tokens = tokens
        self.scheduler = scheduler
        self.forks = forks
        self.speculator = speculator
        self.requests = requests
        self.rows = rows
        self.eviction = eviction
        # async_output: tokens committed by the last step, to render in this one, with
        # whether each shows in the text (see TokenProcessor.append).
        self._committed: list[tuple[Sequence, int, bool]] = []
        self._failures: dict[str, EngineError] = {}  # request id -> why it failed alone

    def emit(
        self,
        seq: Sequence,
        tokens: list[SampledToken],
        now: float,
        failed: Failed,
        *,
        verified: bool = False,
    ) -> list[RequestOutput]:
        """Append ``tokens`` until the request finishes (a verified sequence then rolls
        back): its output, or none, with ``seq`` added to ``failed``, if that raises."""
        out = self.isolating(seq, failed, self._emit, seq, tokens, now, verified)
        return [] if out is None else [out]

    def commit(self, seq: Sequence, token: SampledToken, now: float, failed: Failed) -> None:
        """async_output: what the next step needs of ``token`` now, its rendering queued for
        the next step. A sequence ended meanwhile (by a stop string, in this step's
        rendering) drops its token; one ending here leaves the schedule at once."""
        if seq.finish_reason is not None:
            return
        shows = self.isolating(seq, failed, self.tokens.append, seq, token, now)
        if shows is None:
            return
        if seq.finish_reason is not None:
            # Its output, and its end, come with the rendering; its blocks are free now.
            self.forks.release(seq)
            self.scheduler.remove(seq)
        self._committed.append((seq, token.token_id, shows))

    def render_committed(self) -> list[RequestOutput]:
        """async_output: the outputs of the tokens the last step committed; a stop string
        ends its request here. Requests aborted or failed since are passed over."""
        committed, self._committed = self._committed, []
        outputs: list[RequestOutput] = []
        failed: Failed = []
        for seq, token_id, shows in committed:
            if self.requests.get(seq.request_id) is not seq:
                continue
            out = self.isolating(seq, failed, self._render, seq, token_id, shows)
            if out is not None:
                outputs.append(out)
        return outputs + [
            self.fail(seq, exc) for seq, exc in failed if self.requests.get(seq.request_id) is seq
        ]

    def isolating(
        self, seq: Sequence, failed: Failed, work: Callable[..., T], *args: Any
    ) -> T | None:
        """``work(*args)``, ``seq``'s postprocessing, or None, with ``seq`` added to
        ``failed``, if it raises."""
        try:
            return work(*args)
        except StructuredOutputError as exc:  # the request's grammar: its own fault
            failed.append((seq, exc))
        except Exception as exc:
            logger.exception("postprocessing request %s failed", seq.request_id)
            failed.append((seq, SequenceFailedError(f"postprocessing failed: {exc!r}")))
        return None

    def fail(self, seq: Sequence, error: EngineError) -> RequestOutput:
        """End a request that failed alone: free what it holds, keep why for its caller."""
        self._failures[seq.request_id] = error
        return self.abort(seq)

    def abort(self, seq: Sequence) -> RequestOutput:
        """End a request now ("abort"); its last output."""
        seq.finish_reason = FinishReason.ABORT
        self._finish(seq)
        return self.tokens.output(seq, new_tokens=0, new_text="")

    def take_failures(self) -> dict[str, EngineError]:
        """Requests that failed a step alone since the last call, with their errors."""
        failures, self._failures = self._failures, {}
        return failures

    def _render(self, seq: Sequence, token_id: int, shows: bool) -> RequestOutput:
        return self._conclude(seq, self.tokens.add_text(seq, token_id, shows), 1)

    def _emit(
        self, seq: Sequence, tokens: list[SampledToken], now: float, verified: bool
    ) -> RequestOutput:
        new_text = ""
        count = 0
        for token in tokens:
            new_text += self.tokens.append_with_text(seq, token, now)
            count += 1
            if seq.finish_reason is not None:
                break
        if seq.finish_reason is None and verified:
            assert self.speculator is not None
            self.speculator.commit(seq, count)
        return self._conclude(seq, new_text, count)

    def _conclude(self, seq: Sequence, new_text: str, count: int) -> RequestOutput:
        """The output of ``count`` new tokens; a finished request first releases the text
        held back and ends."""
        if seq.finish_reason is not None:
            new_text += self.tokens.flush(seq)
            self._finish(seq)
        return self.tokens.output(seq, new_tokens=count, new_text=new_text)

    def _finish(self, seq: Sequence) -> None:
        self.forks.release(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.metrics.finished_time = time.monotonic()
        del self.requests[seq.request_id]
        del self.rows[seq.request_id]
        if self.eviction is not None and seq.adapter_ids:
            self.eviction.left(seq.adapter_ids)
