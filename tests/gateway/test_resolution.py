"""The resolve stage (`gateway.resolution`): a `ParsedRequest` → a `Job` a worker can run.

Its pieces at and around their edges (max_tokens against the context and against
`max_generated_tokens`, the sampling params field by field, logit_bias ids), the model name
against a real `TenantStore` on Redis, and `resolve` end to end with the real tokenizer,
tenant store, weights and grammar checker.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import pytest

from gateway.errors import InvalidRequestError, ModelNotFoundError
from gateway.job import Job
from gateway.parsing import parse
from gateway.protocol import ChatCompletionRequest, CompletionRequest, ShapeLimits
from gateway.resolution import (
    MAX_PROMPT_LOGPROB_ENTRIES,
    ModelLimits,
    bound_generated_tokens,
    bound_prompt_logprobs,
    logit_bias_ids,
    resolve,
    resolve_model,
    sampling_params,
    settle_max_tokens,
)
from gateway.structured.constraint import Constraint
from gateway.structured.grammar_checker import GrammarChecker, GrammarLimits
from gateway.tenancy.tenants import Caller, TenantAdapter, TenantStore
from gateway.tenancy.weights import TenantWeights
from rpc import worker_pb2

MODEL = "tiny-chat"
VOCAB = 400  # the test tokenizer's vocabulary (gateway_support.make_model_dir)
TIERS = {"free": 1.0, "standard": 2.0, "premium": 4.0}
SHAPES = ShapeLimits(
    max_stop_strings=16, max_stop_string_chars=256, max_stop_token_ids=64, max_chat_messages=64
)
ACME = Caller(tenant="acme", key_id="key_acme")
GLOBEX = Caller(tenant="globex", key_id="key_globex")
SQL = TenantAdapter(
    name="sql",
    adapter_id="a" * 64,
    created_at=1_700_000_000,
    rank=4,
    target_modules=["q_proj", "v_proj"],
    num_bytes=4096,
)


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": MODEL, "prompt": [35, 36, 37], **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "Hi"}]
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages, **fields})


def limits(**overrides: Any) -> ModelLimits:
    values = {
        "served_model_name": MODEL,
        "max_model_len": 256,
        "max_generated_tokens": 16384,
        "request_timeout_s": 10.0,
    }
    return ModelLimits(**{**values, **overrides})


def params(**fields: Any) -> worker_pb2.SamplingParams:
    """The worker's params with every default a request without sampling fields gets."""
    values = {
        "max_tokens": 16,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "n": 1,
    }
    return worker_pb2.SamplingParams(**{**values, **fields})


def invalid(call, *args, **kwargs) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        call(*args, **kwargs)
    return caught.value


# --- settle_max_tokens ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "default", "prompt_len", "expected"),
    [
        (None, 16, 10, 16),  # the default fits
        (None, 16, 50, 14),  # the default is cut to the rest of the context
        (None, 16, 63, 1),  # one token left
        (None, None, 10, 54),  # no default: the rest of the context
        (None, None, 63, 1),
        (54, 16, 10, 54),  # an explicit value that fills the context exactly
        (1, None, 63, 1),
        (3, 16, 10, 3),  # an explicit value below the default wins
    ],
)
def test_max_tokens_within_the_context(requested, default, prompt_len, expected):
    settled = settle_max_tokens(
        requested=requested, default=default, prompt_len=prompt_len, max_model_len=64
    )
    assert settled == expected


@pytest.mark.parametrize(("requested", "prompt_len"), [(55, 10), (2, 63), (100, 0)])
def test_an_explicit_max_tokens_past_the_context_is_refused(requested, prompt_len):
    error = invalid(
        settle_max_tokens,
        requested=requested,
        default=16,
        prompt_len=prompt_len,
        max_model_len=64,
    )
    assert error.param == "max_tokens"
    assert error.message == (
        f"This model's maximum context length is 64 tokens. However, you requested "
        f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
        "completion). Reduce the prompt or max_tokens."
    )


@pytest.mark.parametrize("requested", [None, 1])
@pytest.mark.parametrize("prompt_len", [64, 65])
@pytest.mark.parametrize("prompt_param", ["prompt", "messages"])
def test_a_prompt_that_fills_the_context_is_refused(requested, prompt_len, prompt_param):
    """Nothing could be generated: refused whatever max_tokens says, naming the prompt's
    field."""
    error = invalid(
        settle_max_tokens,
        requested=requested,
        default=16,
        prompt_len=prompt_len,
        max_model_len=64,
        prompt_param=prompt_param,
    )
    assert (error.param, error.message) == (
        prompt_param,
        f"This model's maximum context length is 64 tokens. However, your prompt has "
        f"{prompt_len} tokens.",
    )


# --- bound_generated_tokens ----------------------------------------------------------------------


@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize(
    ("max_tokens", "samples", "limit"), [(100, 4, 400), (400, 1, 400), (1, 400, 400), (5, 2, 999)]
)
def test_samples_times_max_tokens_within_the_limit_is_kept(max_tokens, samples, limit, explicit):
    kept = bound_generated_tokens(max_tokens, samples=samples, explicit=explicit, limit=limit)
    assert kept == max_tokens


@pytest.mark.parametrize(
    ("max_tokens", "samples", "limit", "cut"),
    [(100, 4, 399, 99), (401, 1, 400, 400), (250, 3, 500, 166), (2, 400, 400, 1)],
)
def test_a_default_max_tokens_past_the_limit_is_cut_to_fit(max_tokens, samples, limit, cut):
    kept = bound_generated_tokens(max_tokens, samples=samples, explicit=False, limit=limit)
    assert kept == cut
    assert samples * kept <= limit < samples * (kept + 1)


def test_an_explicit_max_tokens_past_the_limit_is_refused():
    error = invalid(bound_generated_tokens, 100, samples=4, explicit=True, limit=399)
    assert (error.param, error.message) == (
        "max_tokens",
        "n × max_tokens may be at most 399 tokens; this request asks for 4 × 100",
    )


def test_more_samples_than_the_limit_are_refused_naming_n():
    """Not even one token each fits: cutting max_tokens cannot help, so `n` is named."""
    error = invalid(bound_generated_tokens, 16, samples=401, explicit=False, limit=400)
    assert (error.param, error.message) == (
        "n",
        "n × max_tokens may be at most 400 tokens; this request asks for 401 × 16",
    )


# --- sampling_params -----------------------------------------------------------------------------


def test_sampling_params_defaults():
    """Unset fields become the worker's neutral values; optional fields stay unset."""
    got = sampling_params(completion(), max_tokens=16, logprobs=None, vocab_size=VOCAB)
    assert got == params()
    for optional in ("seed", "logprobs", "num_speculative_tokens", "structured_output"):
        assert not got.HasField(optional), optional


def test_sampling_params_carry_every_field_the_client_set():
    body = completion(
        temperature=0.5,
        top_p=0.25,
        top_k=7,
        min_p=0.125,
        repetition_penalty=1.5,
        presence_penalty=-0.5,
        frequency_penalty=0.75,
        stop=["\n", "END"],
        stop_token_ids=[2, 9],
        ignore_eos=True,
        skip_special_tokens=False,
        n=3,
        seed=1234,
        num_speculative_tokens=4,
        logit_bias={"5": -100.0, "399": 2.5},
    )
    got = sampling_params(body, max_tokens=9, logprobs=2, vocab_size=VOCAB)
    assert got == params(
        max_tokens=9,
        temperature=0.5,
        top_p=0.25,
        top_k=7,
        min_p=0.125,
        repetition_penalty=1.5,
        presence_penalty=-0.5,
        frequency_penalty=0.75,
        stop=["\n", "END"],
        stop_token_ids=[2, 9],
        ignore_eos=True,
        skip_special_tokens=False,
        n=3,
        seed=1234,
        logprobs=2,
        num_speculative_tokens=4,
        logit_bias={5: -100.0, 399: 2.5},
    )


def test_zeros_the_client_set_are_kept_not_defaulted():
    """temperature 0 is greedy (not 1.0); seed, logprobs and speculation 0 are set."""
    body = completion(temperature=0.0, top_k=0, seed=0, num_speculative_tokens=0)
    got = sampling_params(body, max_tokens=4, logprobs=0, vocab_size=VOCAB)
    assert got.temperature == 0.0
    assert got.top_k == 0
    for optional in ("seed", "logprobs", "num_speculative_tokens"):
        assert got.HasField(optional) and getattr(got, optional) == 0, optional


def test_top_k_minus_one_is_passed_on():
    got = sampling_params(completion(top_k=-1), max_tokens=4, logprobs=None, vocab_size=VOCAB)
    assert got.top_k == -1


def test_a_single_stop_string_becomes_a_list():
    got = sampling_params(completion(stop="END"), max_tokens=4, logprobs=None, vocab_size=VOCAB)
    assert list(got.stop) == ["END"]


def test_n_overrides_the_body_for_best_of():
    got = sampling_params(completion(n=2), max_tokens=4, logprobs=0, vocab_size=VOCAB, n=5)
    assert got.n == 5


def test_a_constraint_becomes_the_structured_output():
    constraint = Constraint("regex", "[a-z]+", "guided_regex")
    got = sampling_params(
        completion(), max_tokens=4, logprobs=None, vocab_size=VOCAB, constraint=constraint
    )
    assert got.structured_output == worker_pb2.StructuredOutput(format="regex", text="[a-z]+")


# --- logit_bias_ids ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bias", "ids"),
    [
        (None, {}),
        ({}, {}),
        ({"0": 1.5, "399": -2.0}, {0: 1.5, 399: -2.0}),
        ({"007": 3.0}, {7: 3.0}),  # decimal with leading zeros is the same token
    ],
)
def test_logit_bias_by_token_id(bias, ids):
    assert logit_bias_ids(bias, vocab_size=VOCAB) == ids


@pytest.mark.parametrize("key", ["400", "4000000000"])
def test_logit_bias_keys_past_the_vocabulary_are_refused(key):
    error = invalid(logit_bias_ids, {"1": 0.5, key: 1.0}, vocab_size=VOCAB)
    assert (error.param, error.message) == (
        "logit_bias",
        f"logit_bias keys must be token ids in [0, 400), got {int(key)}",
    )


# --- resolve_model, on a real TenantStore --------------------------------------------------------


@pytest.fixture
async def tenants(redis_client, redis_prefix) -> TenantStore:
    store = TenantStore(redis_client, prefix=redis_prefix)
    for caller in (ACME, GLOBEX):
        await store.create_tenant(caller.tenant)
    assert await store.add_adapter(ACME.tenant, SQL)
    return store


async def test_the_served_model_name_is_the_base_model(tenants):
    adapter = await resolve_model(
        tenants=tenants, caller=ACME, model=MODEL, served_model_name=MODEL
    )
    assert adapter is None


async def test_a_name_of_the_callers_own_is_its_adapter(tenants):
    adapter = await resolve_model(
        tenants=tenants, caller=ACME, model="sql", served_model_name=MODEL
    )
    assert adapter == SQL


async def test_another_tenants_adapter_answers_exactly_like_a_missing_one(tenants):
    """globex cannot learn that acme has an adapter named "sql": same status, code, message."""

    async def refusal(caller: Caller, model: str) -> tuple:
        with pytest.raises(ModelNotFoundError) as caught:
            await resolve_model(
                tenants=tenants, caller=caller, model=model, served_model_name=MODEL
            )
        e = caught.value
        return e.status, e.code, e.type, e.param, e.message

    theirs = await refusal(GLOBEX, "sql")
    missing = await refusal(GLOBEX, "nosuch")
    assert theirs == (
        404,
        "model_not_found",
        "invalid_request_error",
        "model",
        "The model `sql` does not exist.",
    )
    assert missing == (*theirs[:4], "The model `nosuch` does not exist.")


async def test_model_names_are_exact(tenants):
    for name in ("Tiny-Chat", "tiny-chat ", "SQL"):
        with pytest.raises(ModelNotFoundError):
            await resolve_model(tenants=tenants, caller=ACME, model=name, served_model_name=MODEL)


# --- resolve, end to end with real parts ---------------------------------------------------------


@pytest.fixture
async def grammars():
    checker = GrammarChecker(
        GrammarLimits(max_bytes=64 << 10, cache_entries=8, children=1, timeout_s=30.0)
    )
    yield checker
    await checker.close()


@pytest.fixture
def weights(redis_client, redis_prefix) -> TenantWeights:
    return TenantWeights(
        redis_client, prefix=redis_prefix, tiers=TIERS, default_tier="standard", cache_s=0.0
    )


@pytest.fixture
def resolved(tenants, grammars, tokenizer, weights):
    """``resolved(body, caller=…, **limits)``: parse, then resolve with the real parts."""

    async def run(body, *, caller: Caller = ACME, **limit_overrides: Any) -> Job:
        return await resolve(
            parse(body, limits=SHAPES),
            caller=caller,
            tenants=tenants,
            grammars=grammars,
            tokenizer=tokenizer,
            weights=weights,
            limits=limits(**limit_overrides),
        )

    return run


async def resolve_refusal(resolved, body, **kwargs) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        await resolved(body, **kwargs)
    return caught.value


async def test_a_completion_resolves_to_a_job(resolved):
    loop = asyncio.get_running_loop()
    before, wall_before = loop.time(), int(time.time())
    job = await resolved(completion(temperature=0.5))
    after, wall_after = loop.time(), int(time.time())
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", job.request_id)
    assert wall_before <= job.created <= wall_after
    assert before + 10.0 <= job.deadline <= after + 10.0  # request_timeout_s from now
    assert (job.model, job.tenant, job.adapter) == (MODEL, "acme", None)
    assert job.prompt_ids == [35, 36, 37]
    assert job.params == params(max_tokens=16, temperature=0.5)
    assert job.keep is None
    assert job.tenant_weight == 2.0  # the default tier, "standard"
    assert job.reserved_tokens == 3 + 16


async def test_every_request_gets_its_own_id(resolved):
    ids = {(await resolved(completion())).request_id for _ in range(3)}
    assert len(ids) == 3


async def test_a_chat_resolves_to_its_template_and_the_rest_of_the_context(
    resolved, reference_tokenizer
):
    text = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    expected = reference_tokenizer.encode(text, add_special_tokens=False).ids
    job = await resolved(chat(logprobs=True, top_logprobs=2))
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", job.request_id)
    assert job.prompt_ids == expected
    assert job.params == params(max_tokens=256 - len(expected), logprobs=2)


async def test_a_chat_default_max_tokens_is_cut_to_max_generated_tokens(resolved):
    job = await resolved(chat(n=3), max_generated_tokens=60)
    assert (job.params.max_tokens, job.params.n) == (20, 3)
    assert job.reserved_tokens == len(job.prompt_ids) + 60


async def test_an_explicit_max_tokens_past_max_generated_tokens_is_refused(resolved):
    error = await resolve_refusal(resolved, chat(n=3, max_tokens=21), max_generated_tokens=60)
    assert error.param == "max_tokens"


async def test_best_of_generates_more_and_keeps_n(resolved):
    job = await resolved(completion(n=2, best_of=3, max_tokens=5))
    assert job.params == params(max_tokens=5, n=3, logprobs=0)
    assert job.keep == 2
    assert job.reserved_tokens == 3 + 5 * 3


async def test_the_callers_adapter_rides_on_the_job(resolved):
    job = await resolved(completion(model="sql"))
    assert (job.adapter, job.adapter_id, job.model) == (SQL, "a" * 64, "sql")
    assert job.to_proto().adapter_id == "a" * 64


async def test_another_tenants_adapter_is_not_found(resolved):
    with pytest.raises(ModelNotFoundError):
        await resolved(completion(model="sql"), caller=GLOBEX)


async def test_the_model_is_resolved_before_the_prompt(resolved):
    """An unknown model with a prompt past the context is a 404, not a 400."""
    with pytest.raises(ModelNotFoundError):
        await resolved(completion(model="nosuch", prompt=[35] * 300))


async def test_the_tenants_own_weight_rides_on_the_job(resolved, weights):
    await weights.set_weight("acme", 3.0)
    await weights.set_tier("globex", "premium")
    assert (await resolved(completion())).tenant_weight == 3.0
    assert (await resolved(completion(), caller=GLOBEX)).tenant_weight == 4.0
    assert (await resolved(completion())).to_proto().tenant_weight == 3.0


async def test_a_prompt_that_leaves_one_token_gets_one(resolved):
    job = await resolved(completion(prompt=[35] * 255))
    assert job.params.max_tokens == 1


async def test_a_token_id_prompt_that_fills_the_context_is_refused_naming_prompt(resolved):
    error = await resolve_refusal(resolved, completion(prompt=[35] * 256))
    assert (error.param, error.message) == (
        "prompt",
        "This model's maximum context length is 256 tokens. However, your prompt has 256 tokens.",
    )


async def test_a_completion_text_prompt_past_the_context_is_refused_naming_prompt(resolved):
    # 40 one-byte characters: at least ceil(40 / 13) = 4 tokens by the byte bound, 40 once
    # tokenized ("x" is one token), past a context of 32.
    error = await resolve_refusal(resolved, completion(prompt="x" * 40), max_model_len=32)
    assert error.message == (
        "This model's maximum context length is 32 tokens. However, your prompt has 40 tokens."
    )
    assert error.param == "prompt"


async def test_a_logit_bias_key_past_the_vocabulary_is_refused(resolved):
    error = await resolve_refusal(resolved, completion(logit_bias={"400": 1.0}))
    assert (error.param, error.message) == (
        "logit_bias",
        "logit_bias keys must be token ids in [0, 400), got 400",
    )


async def test_a_json_object_response_format_becomes_the_jobs_constraint(resolved):
    job = await resolved(chat(response_format={"type": "json_object"}, max_tokens=8))
    assert job.params.structured_output == worker_pb2.StructuredOutput(format="json_object")


async def test_a_checked_choice_becomes_the_jobs_constraint(resolved):
    job = await resolved(completion(guided_choice=["yes", "no"], max_tokens=2))
    assert job.params.structured_output == worker_pb2.StructuredOutput(
        format="choice", text='["yes", "no"]'
    )


async def test_an_empty_choice_is_refused_before_the_prompt_is_read(resolved):
    error = await resolve_refusal(resolved, completion(guided_choice=[], prompt=[35] * 300))
    assert (error.param, error.message) == (
        "guided_choice",
        "choice needs at least one string",
    )


def test_the_prompts_logprobs_in_every_choice_are_bounded():
    limit = MAX_PROMPT_LOGPROB_ENTRIES
    bound_prompt_logprobs(limit // 42, choices=1, top=20, param="prompt")  # just within
    with pytest.raises(InvalidRequestError) as caught:
        bound_prompt_logprobs(limit // 42, choices=2, top=20, param="n")
    assert caught.value.param == "n" and "at most" in caught.value.message
