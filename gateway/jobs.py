"""From an OpenAI request to a `Job` the workers can run: resolve the model (the prompt's
tokens come from `gateway.prompts`), settle max_tokens against the context, and translate
the sampling fields.

max_tokens defaults (documented in README): completions 16 (OpenAI's default for the
legacy endpoint), chat the whole remaining context; both are capped by the context, and an
explicit value that does not fit is a 400, as vLLM does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from gateway import metrics
from gateway.errors import InvalidRequestError, ModelNotFoundError
from gateway.protocol import SamplingFields
from gateway.tenants import Caller, TenantAdapter, TenantStore
from rpc import worker_pb2

COMPLETIONS_DEFAULT_MAX_TOKENS = 16


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
    tenant_weight: float = 1.0  # the tenant's share under fair scheduling (gateway.scheduling)

    @property
    def reserved_tokens(self) -> int:
        """What the quotas reserve: the prompt and every sample's max_tokens."""
        return len(self.prompt_ids) + self.params.max_tokens * max(self.params.n, 1)

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


async def resolve_model(
    *, tenants: TenantStore, caller: Caller, model: str, served_model_name: str
) -> TenantAdapter | None:
    """None for the base model, else the caller's adapter of that name.

    Adapter names are looked up only among the caller's own, so another tenant's adapter is
    exactly as unknown as one that does not exist (same 404, same message).
    """
    if model == served_model_name:
        metrics.known_model(caller.tenant, model)
        return None
    adapter = await tenants.get_adapter(caller.tenant, model)
    if adapter is None:
        raise ModelNotFoundError(model)
    metrics.known_model(caller.tenant, model)  # a name the tenant registered: a label value
    return adapter


def settle_max_tokens(
    *, requested: int | None, default: int | None, prompt_len: int, max_model_len: int
) -> int:
    """Tokens the request may generate; a prompt or request past the context is a 400."""
    remaining = max_model_len - prompt_len
    if remaining <= 0:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_len} tokens.",
            param="messages",
        )
    if requested is None:
        return remaining if default is None else min(default, remaining)
    if requested > remaining:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
            f"{requested} for the completion). Reduce the prompt or max_tokens.",
            param="max_tokens",
        )
    return requested


def sampling_params(
    body: SamplingFields, *, max_tokens: int, logprobs: int | None, n: int | None = None
) -> worker_pb2.SamplingParams:
    """The worker's params; `n` overrides the body's (best_of generates more than it keeps)."""
    params = worker_pb2.SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        stop=body.stop_strings,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        n=n or body.n,
    )
    if body.seed is not None:
        params.seed = body.seed
    if logprobs is not None:
        params.logprobs = logprobs
    if body.num_speculative_tokens is not None:
        params.num_speculative_tokens = body.num_speculative_tokens
    return params


def new_job(
    body: SamplingFields,
    *,
    id_prefix: str,
    caller: Caller,
    prompt_ids: list[int],
    params: worker_pb2.SamplingParams,
    adapter: TenantAdapter | None,
    timeout_s: float,
    keep: int | None = None,
    tenant_weight: float = 1.0,
) -> Job:
    return Job(
        request_id=f"{id_prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=body.model,
        tenant=caller.tenant,
        prompt_ids=prompt_ids,
        params=params,
        adapter=adapter,
        deadline=asyncio.get_running_loop().time() + timeout_s,
        keep=keep,
        tenant_weight=tenant_weight,
    )
