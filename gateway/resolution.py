"""Resolve: a `ParsedRequest` → a `Job` the workers can run. The model name becomes the base model
or one of the caller's adapters, the output's constraint is built and checked
(`gateway.structured.constraint`), the prompt becomes tokens (`gateway.prompts`), max_tokens is
settled against the context and `max_generated_tokens`, and the sampling fields become the worker's
params. An explicit max_tokens that does not fit is a 400, as vLLM does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from gateway import metrics
from gateway.errors import BaseUnavailableError, InvalidRequestError, ModelNotFoundError
from gateway.fleet.bases import BaseCatalog, ServedBase
from gateway.job import Job
from gateway.parsing import ParsedRequest
from gateway.prompts import prompt_ids
from gateway.protocol import AdapterWeight, SamplingFields
from gateway.routing import WorkerDirectory
from gateway.structured.constraint import Constraint, constraint_for
from gateway.structured.grammar_checker import GrammarChecker
from gateway.tenancy.tenants import Caller, TenantAdapter, TenantStore
from gateway.tenancy.weights import TenantWeights
from gateway.tokenizer import ChatTokenizer
from rpc import worker_pb2


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What a request is resolved against: the served model's name and context, and the
    settings' bounds on generation and time."""

    served_model_name: str
    max_model_len: int
    max_generated_tokens: int
    request_timeout_s: float

    @classmethod
    def of(cls, settings: Any, *, max_model_len: int, base: str | None = None) -> ModelLimits:
        return cls(
            served_model_name=base or settings.served_model_name,
            max_model_len=max_model_len,
            max_generated_tokens=settings.max_generated_tokens,
            request_timeout_s=settings.request_timeout_s,
        )


@dataclass(frozen=True, slots=True)
class Target:
    """What a request's `model` names: a served base, and one of the caller's adapters on it
    (None: the base itself)."""

    base: ServedBase
    adapter: TenantAdapter | None
    default_base: str = ""  # the base of adapters recorded before bases were named

    def base_of(self, adapter: TenantAdapter) -> str:
        return adapter.base or self.default_base


async def resolve_target(
    *,
    model: str,
    caller: Caller,
    tenants: TenantStore,
    directory: WorkerDirectory,
    bases: BaseCatalog,
) -> Target:
    """A live base's name, else the caller's adapter on its base; any other name a 404, as
    before. A base with no live pool (named, or under the adapter) that this gateway served
    before resolves against what it was, so the request's own errors (400) come first and
    routing's 503 names the base; one never served here is that 503 at once."""
    pools = await directory.pools()
    adapter = None
    if model in pools or bases.last_served(model) is not None:
        base_name = model
    else:
        adapter = await tenants.get_adapter(caller.tenant, model)
        if adapter is None:
            raise ModelNotFoundError(model)
        base_name = adapter.base or bases.default.name
    pool = pools.get(base_name)
    base = await bases.served(pool) if pool is not None else bases.last_served(base_name)
    if base is None:
        raise BaseUnavailableError(base_name)
    metrics.known_model(caller.tenant, model)  # a served base or the tenant's own: a label
    return Target(base=base, adapter=adapter, default_base=bases.default.name)


async def resolve(
    parsed: ParsedRequest,
    *,
    caller: Caller,
    tenants: TenantStore,
    grammars: GrammarChecker,
    tokenizer: ChatTokenizer,
    weights: TenantWeights,
    limits: ModelLimits,
    target: Target | None = None,
) -> Job:
    """The model (``target`` when the fleet resolved it already), then the prompt's tokens,
    then the budget and params, then the tenant's scheduling weight (cached: no Redis trip
    as a rule)."""
    body = parsed.body
    if target is not None:
        adapter = target.adapter
    else:
        adapter = await resolve_model(
            tenants=tenants,
            caller=caller,
            model=body.model,
            served_model_name=limits.served_model_name,
        )
    mix = ()
    if body.adapters is not None:
        mix = await resolve_mix(
            tenants=tenants, caller=caller, adapters=body.adapters, model_is_base=adapter is None
        )
        if target is not None:
            check_mix_base(mix, target)
    constraint = await constraint_for(body, checker=grammars, tenant=caller.tenant)
    prompt = await prompt_ids(
        body, tokenizer=tokenizer, max_model_len=limits.max_model_len, tenant=caller.tenant
    )
    if parsed.prompt_logprobs is not None:
        bound_prompt_logprobs(
            len(prompt),
            choices=body.n,
            top=parsed.prompt_logprobs,
            param="n" if body.n > 1 else parsed.prompt_param,
        )
    max_tokens = settle_max_tokens(
        requested=parsed.max_tokens,
        default=parsed.default_max_tokens,
        prompt_len=len(prompt),
        max_model_len=limits.max_model_len,
        prompt_param=parsed.prompt_param,
    )
    max_tokens = bound_generated_tokens(
        max_tokens,
        samples=parsed.samples,
        explicit=parsed.max_tokens is not None,
        limit=limits.max_generated_tokens,
    )
    params = sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=parsed.logprobs,
        prompt_logprobs=parsed.prompt_logprobs,
        n=parsed.best_of,
        vocab_size=tokenizer.vocab_size,
        constraint=constraint,
    )
    weight = await weights.weight(caller.tenant)
    return Job(
        request_id=f"{parsed.id_prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=body.model,
        tenant=caller.tenant,
        prompt_ids=prompt,
        params=params,
        adapter=adapter,
        mix=mix,
        deadline=asyncio.get_running_loop().time() + limits.request_timeout_s,
        keep=body.n if parsed.best_of else None,
        tenant_weight=weight,
        base=target.base.name if target is not None else "",
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


async def resolve_mix(
    *, tenants: TenantStore, caller: Caller, adapters: list[AdapterWeight], model_is_base: bool
) -> tuple[tuple[TenantAdapter, float], ...]:
    """The caller's adapters a request mixes, with their weights (the list's shape is checked
    in parse). An unknown name is the same 404 as in `model`; `model` must name the base."""
    if not model_is_base:
        raise InvalidRequestError(
            "with adapters, model must name the base model: the mix is applied to it",
            param="model",
        )
    mix = []
    for part in adapters:
        adapter = await tenants.get_adapter(caller.tenant, part.name)
        if adapter is None:
            raise ModelNotFoundError(part.name)
        mix.append((adapter, part.weight))
    ids = [a.adapter_id for a, _ in mix]
    if len(set(ids)) != len(ids):
        raise InvalidRequestError(
            "adapters names the same content twice (two names of one adapter)", param="adapters"
        )
    return tuple(mix)


def check_mix_base(mix: tuple[tuple[TenantAdapter, float], ...], target: Target) -> None:
    """Every adapter of a mix must be bound to the base the request names (400 otherwise)."""
    for adapter, _ in mix:
        if target.base_of(adapter) != target.base.name:
            raise InvalidRequestError(
                f"adapter {adapter.name!r} is bound to the base model "
                f"`{target.base_of(adapter)}`, not `{target.base.name}`",
                param="adapters",
            )


def settle_max_tokens(
    *,
    requested: int | None,
    default: int | None,
    prompt_len: int,
    max_model_len: int,
    prompt_param: str = "prompt",
) -> int:
    """Tokens the request may generate; a prompt or request past the context is a 400 (a
    prompt's naming ``prompt_param``: completions' "prompt", chat's "messages")."""
    remaining = max_model_len - prompt_len
    if remaining <= 0:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_len} tokens.",
            param=prompt_param,
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


# A response repeats the prompt's logprobs in every choice: their entries (each token's and
# its alternatives, in both the legacy and vLLM's shapes) are bounded, so a small request
# cannot make the gateway build a body of gigabytes (n × a long prompt × 20 alternatives).
MAX_PROMPT_LOGPROB_ENTRIES = 2**20


def bound_prompt_logprobs(prompt_len: int, *, choices: int, top: int, param: str) -> None:
    """n × prompt tokens × (the token and its ``top`` alternatives, shown twice at most)
    within `MAX_PROMPT_LOGPROB_ENTRIES`; past it a 400 naming ``param``."""
    entries = choices * prompt_len * 2 * (1 + top)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise InvalidRequestError(
            f"the prompt's logprobs would hold {entries} entries ({choices} choices × "
            f"{prompt_len} prompt tokens × {2 * (1 + top)}); at most "
            f"{MAX_PROMPT_LOGPROB_ENTRIES} are allowed: lower n, the alternatives or the prompt",
            param=param,
        )


def sampling_params(
    body: SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    prompt_logprobs: int | None = None,
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
    if prompt_logprobs is not None:
        params.prompt_logprobs = prompt_logprobs
    if body.num_speculative_tokens is not None:
        params.num_speculative_tokens = body.num_speculative_tokens
    return params


def logit_bias_ids(bias: dict[str, float] | None, *, vocab_size: int) -> dict[int, float]:
    """`logit_bias` (already `check_logit_bias`ed) by token id, each below ``vocab_size``."""
    ids = {int(key): value for key, value in (bias or {}).items()}
    outside = [token for token in ids if token >= vocab_size]
    if outside:
        raise InvalidRequestError(
            f"logit_bias keys must be token ids in [0, {vocab_size}), got {outside[0]}",
            param="logit_bias",
        )
    return ids


async def list_models(
    *, caller: Caller, tenants: TenantStore, directory: WorkerDirectory, bases: BaseCatalog
) -> dict[str, Any]:
    """The names a caller may resolve: the gateway's default base and every live base, then
    the caller's own adapters, each with its base as `parent` (shaped like vLLM's LoRA
    entries)."""
    served = {bases.default.name: bases.default}
    for name, pool in (await directory.pools()).items():
        try:
            served[name] = await bases.served(pool)
        except BaseUnavailableError:
            continue  # a base this gateway cannot read is not offered
    entries = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "switchboard",
            "root": base.content_id or name,
            "parent": None,
            "max_model_len": base.max_model_len,
        }
        for name, base in served.items()
    ]
    for a in await tenants.list_adapters(caller.tenant):
        parent = a.base or bases.default.name
        entry = {
            "id": a.name,
            "object": "model",
            "created": a.created_at,
            "owned_by": caller.tenant,
            "root": a.adapter_id,
            "parent": parent,
        }
        if parent in served:
            entry["max_model_len"] = served[parent].max_model_len
        entries.append(entry)
    return {"object": "list", "data": entries}
