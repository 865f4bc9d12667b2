"""A request the gateway has resolved: what route, relay and settle work on (built by
`gateway.resolution`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.errors import GatewayError, InvalidRequestError
from gateway.tenancy.tenants import TenantAdapter
from rpc import worker_pb2


@dataclass(frozen=True, slots=True)
class Job:
    """One request, ready to route: tokens, sampling, adapter, deadline (event-loop time)."""

    request_id: str
    created: int
    model: str  # as the client named it; echoed in responses
    tenant: str
    prompt_ids: list[int]
    params: worker_pb2.SamplingParams
    adapter: TenantAdapter | None
    deadline: float
    keep: int | None = None  # best_of: return only the `keep` most likely samples
    # A weighted mix of the caller's adapters (then ``adapter`` is None): (adapter, weight).
    mix: tuple[tuple[TenantAdapter, float], ...] = ()
    tenant_weight: float = 1.0  # the tenant's share under fair scheduling (gateway.tenancy.weights)
    base: str = ""  # the base whose pool serves it ("": the default base)
    # Its band: interactive work goes ahead of batch work (the Batch API's lines) in the
    # gateway's queue and the engine's scheduler.
    priority: int = worker_pb2.PRIORITY_INTERACTIVE

    @property
    def reserved_tokens(self) -> int:
        """What the quotas reserve: the prompt and every sample's max_tokens."""
        return len(self.prompt_ids) + self.params.max_tokens * max(self.params.n, 1)

    def remaining_s(self) -> float:
        """Seconds left until the deadline (negative once past)."""
        return self.deadline - asyncio.get_running_loop().time()

    @property
    def adapter_id(self) -> str | None:
        """The adapter routing prefers a holder of: the request's, or its mix's first."""
        if self.mix:
            return self.mix[0][0].adapter_id
        return self.adapter.adapter_id if self.adapter else None

    def named(self, error: GatewayError) -> GatewayError:
        """A worker's refusal of this request (its mix, its adapter's overflowing numbers),
        naming the caller's adapters where the worker (which knows content ids only) named
        their ids."""
        adapters = [a for a, _ in self.mix] or ([self.adapter] if self.adapter else [])
        if not adapters or not isinstance(error, InvalidRequestError):
            return error
        message = error.message
        for adapter in adapters:
            message = message.replace(repr(adapter.adapter_id), repr(adapter.name))
        if self.mix:
            return InvalidRequestError(message, param="adapters")
        return error if message == error.message else InvalidRequestError(message, param="model")

    def to_proto(self) -> worker_pb2.GenerateRequest:
        return worker_pb2.GenerateRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            params=self.params,
            adapter_id=self.adapter.adapter_id if self.adapter else "",
            tenant=self.tenant,
            tenant_weight=self.tenant_weight,
            priority=self.priority,
            adapter_mix=[
                worker_pb2.AdapterWeight(adapter_id=a.adapter_id, weight=w) for a, w in self.mix
            ],
        )
