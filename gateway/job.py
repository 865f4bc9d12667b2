"""A request the gateway has resolved: what route, relay and settle work on (built by
`gateway.resolution`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

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
    tenant_weight: float = 1.0  # the tenant's share under fair scheduling (gateway.tenancy.weights)

    @property
    def reserved_tokens(self) -> int:
        """What the quotas reserve: the prompt and every sample's max_tokens."""
        return len(self.prompt_ids) + self.params.max_tokens * max(self.params.n, 1)

    def remaining_s(self) -> float:
        """Seconds left until the deadline (negative once past)."""
        return self.deadline - asyncio.get_running_loop().time()

    @property
    def adapter_id(self) -> str | None:
        return self.adapter.adapter_id if self.adapter else None

    def to_proto(self) -> worker_pb2.GenerateRequest:
        return worker_pb2.GenerateRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            params=self.params,
            adapter_id=self.adapter.adapter_id if self.adapter else "",
            tenant=self.tenant,
            tenant_weight=self.tenant_weight,
        )
