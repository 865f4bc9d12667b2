"""Incremental detokenization: text deltas, one generated token at a time.

Decoding one token at a time is wrong in two ways: a multi-byte character may be split across
byte-level tokens (a partial UTF-8 sequence decodes to U+FFFD), and SentencePiece-style
decoders drop the leading space of the first token they see. So, as vLLM does, each step
decodes a small window of ids twice, `ids[prefix:read]` and `ids[prefix:]`, and emits the
difference; text ending in U+FFFD is held back until its character completes. Cost per token
is O(window): the window restarts after every emitted delta.
"""

from __future__ import annotations

from typing import Any

from worker.text.byte_level import ByteLevelDetokenizer, token_bytes

# Prompt tokens decoded as context before the first output token (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5
# A partial UTF-8 sequence is at most 3 bytes, so at most the last 3 tokens (of >= 1 byte each);
# past this many held-back tokens, the older ones are final and released.
MAX_HELD_TOKENS = 8
REPLACEMENT = "\ufffd"


def make_detokenizer(
    tokenizer: Any, prompt_token_ids: list[int], *, skip_special_tokens: bool = True
) -> IncrementalDetokenizer | ByteLevelDetokenizer:
    """The detokenizer for one request: byte-level tokenizers get the table-driven one
    (`worker.text.byte_level`), the others this module's."""
    backend = tokenizer.backend_tokenizer
    table = token_bytes(backend)
    if table is None:
        return IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens
        )
    return ByteLevelDetokenizer(table, special_ids(backend) if skip_special_tokens else frozenset())


def special_ids(backend: Any) -> frozenset[int]:
    """The ids of a ``tokenizers.Tokenizer``'s special added tokens."""
    return frozenset(
        token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
    )


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas whose concatenation is the full decode.

    For byte-level BPE (Llama 3, Qwen2, SmolLM2), the deltas add up to exactly
    `tokenizer.decode(output_ids, skip_special_tokens=...)`. Decoding continues the prompt
    (its last tokens are the first window), so a SentencePiece tokenizer's first output token
    keeps its leading space, as in vLLM; the output is `decode(prompt + output)` minus
    `decode(prompt)`. A prompt that ends inside a character is not used as context.
    `clean_up_tokenization_spaces` (WordPiece only) is not applied.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        # The Rust tokenizer behind a transformers fast tokenizer: its decode is what
        # `tokenizer.decode` runs (transformers only adds an optional WordPiece clean-up).
        self._backend = tokenizer.backend_tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._skipped = special_ids(self._backend) if skip_special_tokens else frozenset()
        context = [t for t in prompt_token_ids if t not in self._skipped]
        context = context[-PROMPT_CONTEXT_TOKENS:]
        if self._decode(context).endswith(REPLACEMENT):
            context = []  # the prompt ends inside a character: output must not complete it
        self._ids: list[int] = context  # the decode window: ids[prefix:] are still needed
        self._prefix = 0  # ids[prefix:read] is decoded only as context
        self._read = len(context)  # ids[read:] is not emitted yet

    def add(self, token_id: int) -> str:
        """Appends one generated token; returns the text it finalizes (often "")."""
        if token_id in self._skipped:
            return ""  # the decoder never sees it, so dropping it changes nothing
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if new_text.endswith(REPLACEMENT):
            if len(self._ids) - self._read > MAX_HELD_TOKENS:
                return self._release_final_part(prefix_text, new_text)
            return ""  # maybe a character still incomplete
        if len(new_text) <= len(prefix_text):
            return ""  # nothing visible yet (keeps context for leading-space decoders)
        return self._emit(new_text[len(prefix_text) :], len(self._ids))

    def finish(self) -> str:
        """Flushes what is held back (a trailing partial character decodes to U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text):
            return ""
        return self._emit(new_text[len(prefix_text) :], len(self._ids))

    def _emit(self, delta: str, read: int) -> str:
        """Emits delta, the text of ids[read_before:read]; ids[old read:read] become context."""
        self._prefix, self._read = self._read, read
        del self._ids[: self._prefix]  # keep the window small: only ids[prefix:] matter
        self._read -= self._prefix
        self._prefix = 0
        return delta

    def _release_final_part(self, prefix_text: str, new_text: str) -> str:
        """Emits the text before the last 3 held tokens, at a split that no character straddles.

        Appending bytes only changes how a trailing partial sequence (<= 3 bytes) decodes, so
        text of ids[:split] that is a prefix of the whole window's text is final.
        """
        end = len(self._ids) - 3
        for split in range(end, max(self._read, end - 4), -1):
            text = self._decode(self._ids[self._prefix : split])
            if len(text) > len(prefix_text) and new_text.startswith(text):
                return self._emit(text[len(prefix_text) :], split)
        return ""

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
