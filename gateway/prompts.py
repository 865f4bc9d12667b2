"""A request's prompt as token ids, refused as early and as cheaply as it can be.

Order of work, cheapest first: a token-id prompt's count; a text's byte length against the
context (`ChatTokenizer.min_tokens`, no tokenizing); only then templating and tokenizing,
both on the tokenizer's thread pool once they are large.
"""

from __future__ import annotations

from gateway.errors import InvalidRequestError
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.structured.tool_rendering import template_input
from gateway.tokenizer import ChatTokenizer


def context_error(max_model_len: int, prompt_tokens: str, *, param: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt has {prompt_tokens} tokens.",
        param=param,
    )


def check_text_fits(text: str, *, tokenizer: ChatTokenizer, max_model_len: int, param: str) -> None:
    """A text whose bytes alone need more tokens than the context holds is refused untokenized."""
    at_least = tokenizer.min_tokens(text)
    if at_least >= max_model_len:
        raise context_error(max_model_len, f"at least {at_least}", param=param)


async def completion_prompt_ids(
    body: CompletionRequest, *, tokenizer: ChatTokenizer, max_model_len: int, tenant: str = ""
) -> list[int]:
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        check_text_fits(prompt, tokenizer=tokenizer, max_model_len=max_model_len, param="prompt")
        return await tokenizer.encode_async(prompt, add_special_tokens=True, tenant=tenant)
    if len(prompt) >= max_model_len:
        raise context_error(max_model_len, str(len(prompt)), param="prompt")
    vocab = tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in prompt):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    return list(prompt)


async def chat_prompt_ids(
    body: ChatCompletionRequest, *, tokenizer: ChatTokenizer, max_model_len: int, tenant: str = ""
) -> list[int]:
    messages = [m.for_template(i) for i, m in enumerate(body.messages)]
    # The model sees the tools only when it may call them (tool_choice other than "none").
    shown = [t.function.for_template() for t in body.tools or []] if body.calls_tools else None
    messages, tools = template_input(messages, shown, native=tokenizer.renders_tools)
    text = await tokenizer.render_chat_async(
        messages,
        add_generation_prompt=body.add_generation_prompt,
        tools=tools,
        switches=body.template_switches,
        tenant=tenant,
    )
    check_text_fits(text, tokenizer=tokenizer, max_model_len=max_model_len, param="messages")
    # The template writes the special tokens itself, so none are added (like transformers).
    return await tokenizer.encode_async(text, add_special_tokens=False, tenant=tenant)


async def prompt_ids(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    tokenizer: ChatTokenizer,
    max_model_len: int,
    tenant: str = "",
) -> list[int]:
    """The prompt of either endpoint as token ids (long ones on the tokenizer's pool, in
    ``tenant``'s turn)."""
    if isinstance(body, ChatCompletionRequest):
        return await chat_prompt_ids(
            body, tokenizer=tokenizer, max_model_len=max_model_len, tenant=tenant
        )
    return await completion_prompt_ids(
        body, tokenizer=tokenizer, max_model_len=max_model_len, tenant=tenant
    )
