"""Resolve: a `ParsedRequest` → a `Job` the workers can run. The model name becomes the base
model or one of the caller's adapters, the output's constraint is built and checked
(`gateway.structured`), the prompt becomes tokens (`gateway.prompts`), max_tokens is settled
against the context and `max_generated_tokens`, and the sampling fields become the worker's
params. An explicit max_tokens that does not fit is a 400, as
vLLM does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway import metrics
from gateway.errors import InvalidRequestError, ModelNotFoundError
from gateway.parsing import ParsedRequest
from gateway.prompts import prompt_ids
from gateway.protocol import SamplingFields, logit_bias_ids
from gateway.structured import Constraint, constraint_for
from gateway.tenants import Caller, TenantAdapter, TenantStore
from rpc import worker_pb2

if TYPE_CHECKING:
    from gateway.state import GatewayState


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


async def resolve(parsed: ParsedRequest, *, caller: Caller, state: GatewayState) -> Job:
    """The model, then the prompt's tokens, then the budget and params, then the tenant's
    scheduling weight (cached: no Redis trip as a rule)."""
    body = parsed.body
    adapter = await resolve_model(
        tenants=state.tenants,
        caller=caller,
        model=body.model,
        served_model_name=state.settings.served_model_name,
    )
    constraint = await constraint_for(body, checker=state.grammars)
    prompt = await prompt_ids(body, tokenizer=state.tokenizer, max_model_len=state.max_model_len)
    max_tokens = settle_max_tokens(
        requested=parsed.max_tokens,
        default=parsed.default_max_tokens,
        prompt_len=len(prompt),
        max_model_len=state.max_model_len,
    )
    max_tokens = bound_generated_tokens(
        max_tokens,
        samples=parsed.samples,
        explicit=parsed.max_tokens is not None,
        limit=state.settings.max_generated_tokens,
    )
    params = sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=parsed.logprobs,
        n=parsed.best_of,
        vocab_size=state.tokenizer.vocab_size,
        constraint=constraint,
    )
    weight = await state.scheduling.weight(caller.tenant)
    return Job(
        request_id=f"{parsed.id_prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=body.model,
        tenant=caller.tenant,
        prompt_ids=prompt,
        params=params,
        adapter=adapter,
        deadline=asyncio.get_running_loop().time() + state.settings.request_timeout_s,
        keep=body.n if parsed.best_of else None,
        tenant_weight=weight,
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


def bound_generated_tokens(max_tokens: int, *, samples: int, explicit: bool, limit: int) -> int:
    """n (or best_of) × max_tokens within `max_generated_tokens`: an explicit max_tokens past
    it is a 400; a default one is cut to fit."""
    if samples * max_tokens <= limit:
        return max_tokens
    if explicit or samples > limit:
        raise InvalidRequestError(
            f"n × max_tokens may be at most {limit} tokens; this request asks for "
            f"{samples} × {max_tokens}",
            param="max_tokens" if explicit else "n",
        )
    return limit // samples


def sampling_params(
    body: SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    n: int | None = None,
    constraint: Constraint | None = None,
) -> worker_pb2.SamplingParams:
    """The worker's params; `n` overrides the body's (best_of generates more than it keeps);
    logit_bias keys must be below ``vocab_size``."""
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
        logit_bias=logit_bias_ids(body.logit_bias, vocab_size=vocab_size),
    )
    if constraint is not None:
        params.structured_output.CopyFrom(constraint.to_proto())
    if body.seed is not None:
        params.seed = body.seed
    if logprobs is not None:
        params.logprobs = logprobs
    if body.num_speculative_tokens is not None:
        params.num_speculative_tokens = body.num_speculative_tokens
    return params


async def list_models(*, state: GatewayState, caller: Caller) -> dict[str, Any]:
    """The names a caller may resolve: the base model, then the caller's own adapters
    (shaped like vLLM's LoRA entries)."""
    base_id = state.settings.served_model_name
    base = {
        "id": base_id,
        "object": "model",
        "created": 0,
        "owned_by": "switchboard",
        "root": base_id,
        "parent": None,
        "max_model_len": state.max_model_len,
    }
    adapters = [
        {
            "id": a.name,
            "object": "model",
            "created": a.created_at,
            "owned_by": caller.tenant,
            "root": a.adapter_id,
            "parent": base_id,
            "max_model_len": state.max_model_len,
        }
        for a in await state.tenants.list_adapters(caller.tenant)
    ]
    return {"object": "list", "data": [base, *adapters]}
