"""`gateway.prompts`: a request's prompt as token ids, refused as early as it can be.

The tokenizer is the gateway's real `ChatTokenizer` on the test checkpoint
(`gateway_support.make_model_dir`: a byte-level BPE and a ChatML template); the expected ids
are the `tokenizers` library's own encoding of the text written out here by hand.
"""

from __future__ import annotations

import math
import shutil
from typing import Any

import pytest

from gateway.errors import InvalidRequestError
from gateway.prompts import chat_prompt_ids, completion_prompt_ids, prompt_ids
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.tokenizer import ChatTokenizer

MODEL = "tiny-chat"
VOCAB = 400
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
ASSISTANT = "<|im_start|>assistant\n"
WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def char_id(char: str) -> int:
    """The token of one printable ASCII character: the byte alphabet follows the three
    special tokens in code point order, from "!" (id 3)."""
    return 3 + ord(char) - ord("!")


def completion(prompt: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": MODEL, "prompt": prompt})


def chat(*messages: dict[str, Any], **fields: Any) -> ChatCompletionRequest:
    body = {"model": MODEL, "messages": list(messages), **fields}
    return ChatCompletionRequest.model_validate(body)


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def turn(role: str, content: str) -> str:
    """One ChatML turn as the template writes it."""
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


@pytest.fixture
def encode(reference_tokenizer):
    """The expected ids of a text: `tokenizers` on the same file, no special tokens added."""
    return lambda text: reference_tokenizer.encode(text, add_special_tokens=False).ids


@pytest.fixture
def longest_token_bytes(reference_tokenizer) -> int:
    """The most UTF-8 bytes one vocabulary entry spells (the byte bound's divisor)."""
    return max(
        len(token.encode()) for token in reference_tokenizer.get_vocab(with_added_tokens=True)
    )


async def refused(make_ids, body, tokenizer, *, max_model_len: int) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        await make_ids(body, tokenizer=tokenizer, max_model_len=max_model_len)
    assert caught.value.status == 400
    return caught.value


# --- completions: text ---------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["Hello, world!", ["Hello, world!"]])
async def test_a_text_prompt_is_tokenized(tokenizer, encode, prompt):
    ids = await completion_prompt_ids(completion(prompt), tokenizer=tokenizer, max_model_len=256)
    assert ids == encode("Hello, world!")
    assert len(ids) == 4  # "Hello" "," " world" "!"


async def test_a_long_text_is_tokenized_on_the_pool_to_the_same_ids(tokenizer, encode):
    text = "The quick brown fox jumps over the lazy dog. " * 300  # past INLINE_CHARS
    ids = await completion_prompt_ids(completion(text), tokenizer=tokenizer, max_model_len=10**6)
    assert ids == encode(text)


async def test_a_text_whose_bytes_cannot_fit_is_refused_untokenized(tokenizer, longest_token_bytes):
    """1,000,000 bytes need at least ceil(1e6 / 13) tokens: refused by the byte bound alone
    (its message says "at least"), never tokenized."""
    assert longest_token_bytes == 13  # "<|endoftext|>"
    error = await refused(
        completion_prompt_ids, completion("x" * 1_000_000), tokenizer, max_model_len=256
    )
    assert (error.param, error.message) == (
        "prompt",
        "This model's maximum context length is 256 tokens. However, your prompt has at least "
        f"{math.ceil(1_000_000 / 13)} tokens.",
    )


@pytest.mark.parametrize(
    ("text", "at_least"),
    [("x" * 40, 4), ("x" * 52, 4), ("é" * 20, 4), ("x" * 53, 5)],  # "é" is 2 bytes
)
async def test_the_byte_bound_refuses_at_the_context(tokenizer, text, at_least):
    error = await refused(completion_prompt_ids, completion(text), tokenizer, max_model_len=4)
    assert error.message == (
        "This model's maximum context length is 4 tokens. However, your prompt has at least "
        f"{at_least} tokens."
    )


async def test_a_text_within_the_byte_bound_is_tokenized_even_past_the_context(tokenizer):
    """The bound is a lower one: 39 bytes may be 3 tokens, so the text is tokenized (39
    tokens) and the context is checked on its real count later (`resolution`)."""
    ids = await completion_prompt_ids(completion("x" * 39), tokenizer=tokenizer, max_model_len=4)
    assert ids == [char_id("x")] * 39


# --- completions: token ids ----------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [[0, 35, 399], [[0, 35, 399]]])
async def test_token_ids_are_the_prompt_as_given(tokenizer, prompt):
    ids = await completion_prompt_ids(completion(prompt), tokenizer=tokenizer, max_model_len=256)
    assert ids == [0, 35, 399]


async def test_token_ids_up_to_one_short_of_the_context_are_accepted(tokenizer):
    ids = await completion_prompt_ids(completion([35] * 7), tokenizer=tokenizer, max_model_len=8)
    assert ids == [35] * 7


@pytest.mark.parametrize("count", [8, 9])
async def test_token_ids_that_fill_the_context_are_refused(tokenizer, count):
    error = await refused(
        completion_prompt_ids, completion([35] * count), tokenizer, max_model_len=8
    )
    assert (error.param, error.message) == (
        "prompt",
        f"This model's maximum context length is 8 tokens. However, your prompt has {count} "
        "tokens.",
    )


@pytest.mark.parametrize("prompt", [[35, 400], [-1], [10**6]])
async def test_token_ids_outside_the_vocabulary_are_refused(tokenizer, prompt):
    error = await refused(completion_prompt_ids, completion(prompt), tokenizer, max_model_len=256)
    assert (error.param, error.message) == ("prompt", "prompt token ids must be in [0, 400)")


async def test_the_count_is_checked_before_the_ids(tokenizer):
    error = await refused(completion_prompt_ids, completion([400] * 8), tokenizer, max_model_len=8)
    assert error.message.endswith("your prompt has 8 tokens.")


@pytest.mark.parametrize("prompt", ["", [], [""], [[]]])
async def test_an_empty_prompt_is_refused(tokenizer, prompt):
    error = await refused(completion_prompt_ids, completion(prompt), tokenizer, max_model_len=256)
    assert (error.param, error.message) == ("prompt", "prompt must not be empty")


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]]])
async def test_a_batch_of_prompts_is_refused(tokenizer, prompt):
    error = await refused(completion_prompt_ids, completion(prompt), tokenizer, max_model_len=256)
    assert (error.param, error.message) == (
        "prompt",
        "a list of prompts is not supported; send one prompt per request",
    )


# --- chat ----------------------------------------------------------------------------------------


async def test_a_chat_is_its_template_tokenized_without_added_special_tokens(tokenizer, encode):
    ids = await chat_prompt_ids(chat(user("Hi")), tokenizer=tokenizer, max_model_len=256)
    assert ids == encode(DEFAULT_SYSTEM + turn("user", "Hi") + ASSISTANT)
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> once a turn, not once more


async def test_a_chats_own_system_message_replaces_the_default(tokenizer, encode):
    body = chat({"role": "system", "content": "Be brief."}, user("Hi"))
    ids = await chat_prompt_ids(body, tokenizer=tokenizer, max_model_len=256)
    assert ids == encode(turn("system", "Be brief.") + turn("user", "Hi") + ASSISTANT)


async def test_a_developer_message_is_a_system_message(tokenizer, encode):
    body = chat({"role": "developer", "content": "Be brief."}, user("Hi"))
    ids = await chat_prompt_ids(body, tokenizer=tokenizer, max_model_len=256)
    assert ids == encode(turn("system", "Be brief.") + turn("user", "Hi") + ASSISTANT)


async def test_without_a_generation_prompt_no_assistant_turn_is_opened(tokenizer, encode):
    body = chat(user("Hi"), {"role": "assistant", "content": "Hel"}, add_generation_prompt=False)
    ids = await chat_prompt_ids(body, tokenizer=tokenizer, max_model_len=256)
    assert ids == encode(DEFAULT_SYSTEM + turn("user", "Hi") + turn("assistant", "Hel"))


async def test_text_parts_are_joined_and_null_content_is_empty(tokenizer, encode):
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    body = chat(user(parts), {"role": "assistant", "content": None}, add_generation_prompt=False)
    ids = await chat_prompt_ids(body, tokenizer=tokenizer, max_model_len=256)
    assert ids == encode(DEFAULT_SYSTEM + turn("user", "Hello") + turn("assistant", ""))


async def test_a_part_other_than_text_is_refused_naming_its_message(tokenizer):
    parts = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": "x"}}]
    body = chat(user("Hi"), user(parts))
    error = await refused(chat_prompt_ids, body, tokenizer, max_model_len=256)
    assert (error.param, error.message) == (
        "messages.1.content",
        "content part type 'image_url' is not supported (text only)",
    )


async def test_a_large_conversation_renders_on_the_pool_to_the_same_ids(tokenizer, encode):
    long = "Hello, world! " * 700  # past INLINE_CHARS
    ids = await chat_prompt_ids(chat(user(long)), tokenizer=tokenizer, max_model_len=10**6)
    assert ids == encode(DEFAULT_SYSTEM + turn("user", long) + ASSISTANT)


async def test_a_rendered_chat_past_the_byte_bound_is_refused_naming_messages(
    tokenizer, longest_token_bytes
):
    text = DEFAULT_SYSTEM + turn("user", "Hi") + ASSISTANT
    at_least = math.ceil(len(text.encode()) / longest_token_bytes)
    assert at_least == 9  # 108 bytes
    error = await refused(chat_prompt_ids, chat(user("Hi")), tokenizer, max_model_len=9)
    assert (error.param, error.message) == (
        "messages",
        "This model's maximum context length is 9 tokens. However, your prompt has at least "
        "9 tokens.",
    )


async def test_tools_the_model_may_not_call_are_not_shown(tokenizer, encode):
    body = chat(user("Hi"), tools=[WEATHER], tool_choice="none")
    ids = await chat_prompt_ids(body, tokenizer=tokenizer, max_model_len=256)
    assert ids == encode(DEFAULT_SYSTEM + turn("user", "Hi") + ASSISTANT)


async def test_tools_are_shown_in_a_system_message_when_the_template_reads_none(tokenizer, encode):
    """The ChatML template does not read `tools`: the Hermes fallback lists them."""
    tools_prompt = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "parameters": '
        '{"type": "object", "properties": {}}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    body = chat(user("Hi"), tools=[WEATHER])
    ids = await chat_prompt_ids(body, tokenizer=tokenizer, max_model_len=4096)
    assert ids == encode(turn("system", tools_prompt) + turn("user", "Hi") + ASSISTANT)


async def test_a_model_without_a_chat_template_refuses_chats(model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    tokenizer = ChatTokenizer.from_dir(tmp_path)
    try:
        error = await refused(chat_prompt_ids, chat(user("Hi")), tokenizer, max_model_len=256)
    finally:
        tokenizer.close()
    assert (error.param, error.message) == (
        "messages",
        "this model has no chat template; use /v1/completions",
    )


async def test_a_conversation_the_template_rejects_is_refused_with_its_reason(model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversations must start with a user message') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    tokenizer = ChatTokenizer.from_dir(tmp_path)
    try:
        ids = await chat_prompt_ids(chat(user("Hi")), tokenizer=tokenizer, max_model_len=256)
        body = chat({"role": "assistant", "content": "Hi"})
        error = await refused(chat_prompt_ids, body, tokenizer, max_model_len=256)
    finally:
        tokenizer.close()
    assert ids == [char_id("H"), char_id("i")]
    assert (error.param, error.message) == (
        "messages",
        "chat template: Conversations must start with a user message",
    )


# --- either endpoint -----------------------------------------------------------------------------


async def test_prompt_ids_dispatches_on_the_endpoint(tokenizer, encode):
    as_chat = await prompt_ids(chat(user("Hi")), tokenizer=tokenizer, max_model_len=256)
    as_text = await prompt_ids(completion("Hi"), tokenizer=tokenizer, max_model_len=256)
    assert as_chat == encode(DEFAULT_SYSTEM + turn("user", "Hi") + ASSISTANT)
    assert as_text == encode("Hi") == [char_id("H"), char_id("i")]
