"""What one request consumed so far, and where its worker call runs: written by routing and
relay, read by settlement, whatever the request's end (finished, failed, client gone)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway import metrics
from gateway.errors import ClientDisconnectedError
from gateway.fair_queue import Grant
from gateway.worker_client import WorkerChannels, WorkerReply
from rpc import worker_pb2


@dataclass(frozen=True, slots=True)
class RunningCall:
    """Where a request's worker call runs, for asking that worker to abort it."""

    channels: WorkerChannels
    address: str
    request_id: str
    tenant: str


@dataclass(slots=True)
class Tally:
    """What a request consumed so far, for quota settlement and usage, whatever its end."""

    arrived: float = field(default_factory=time.monotonic)  # when the gateway got it
    started: bool = False  # the worker answered: the prompt was processed
    completion: dict[int, int] = field(default_factory=dict)  # sample index → tokens
    cached_tokens: int = 0
    last_message_at: float = 0.0
    called_at: float = 0.0  # the call to the worker that answered went out
    answered_at: float = 0.0  # ... and its first message (unary: its reply) came in
    error_status: int | None = None  # a failure after the response started
    finished: bool = False  # the whole response was produced
    running_on: RunningCall | None = None  # a worker call that has not ended by itself
    reported_completion: int = 0  # every sample's tokens, as an aborting worker counted them
    grant: Grant | None = None  # the request's worker slot, released when it is settled

    def record(self, message: worker_pb2.GenerateResponse) -> None:
        now = time.monotonic()
        if self.started:
            metrics.INTER_TOKEN_LATENCY.observe(now - self.last_message_at)
        else:
            metrics.TIME_TO_FIRST_TOKEN.observe(now - self.arrived)
        self.started = True
        self.last_message_at = now
        self.completion[message.index] = message.completion_tokens
        self.cached_tokens = max(self.cached_tokens, message.cached_tokens)

    def record_reply(self, reply: WorkerReply) -> None:
        """A whole answer at once (not streamed): its first token's time, no gaps."""
        metrics.TIME_TO_FIRST_TOKEN.observe(reply.first_token_at - self.arrived)
        self.started = True
        for message in reply.responses:
            self.completion[message.index] = message.completion_tokens
            self.cached_tokens = max(self.cached_tokens, message.cached_tokens)

    def overhead_s(self) -> float:
        """The gateway's own time on the request until now: all of it since arrival but the
        wait for the worker that answered (a failed try's time counts, as a client waits
        it too). Like LiteLLM's ``x-litellm-overhead-duration-ms``."""
        return time.monotonic() - self.arrived - (self.answered_at - self.called_at)

    @property
    def status(self) -> int:
        """The request's outcome as an HTTP status, once its response is over."""
        if self.error_status is not None:
            return self.error_status
        return 200 if self.finished else ClientDisconnectedError.status

    def charge_reported(self, report: worker_pb2.AbortResponse) -> None:
        """What an aborted request's worker says it processed (prompt) and generated."""
        self.started = True
        self.reported_completion = max(self.reported_completion, report.completion_tokens)
        self.cached_tokens = max(self.cached_tokens, report.cached_tokens)

    @property
    def completion_tokens(self) -> int:
        return max(sum(self.completion.values()), self.reported_completion)
