"""Incremental detokenization: text deltas, one generated token at a time.

Decoding one token at a time is wrong in two ways: a multi-byte character may be split across
byte-level tokens (a partial UTF-8 sequence decodes to U+FFFD), and SentencePiece-style
decoders drop the leading space of the first token they see. So, as vLLM does, each step
decodes a small window of ids twice, `ids[prefix:read]` and `ids[prefix:]`, and emits the
difference; text ending in U+FFFD is held back until its character completes. Cost per token
is O(window): the window restarts after every emitted delta. For a byte-level decoder
(GPT-2, Llama 3, Qwen2, SmolLM2) the first of the two decodes is known without decoding:
there, text decodes piecewise at character boundaries, so after a delta whose window held
only whole characters, the next window's text is that delta.
"""

from __future__ import annotations

from typing import Any

from tokenizers import decoders

# Prompt tokens decoded as context before the first output token (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5
# A partial UTF-8 sequence is at most 3 bytes, so at most the last 3 tokens (of >= 1 byte each);
# past this many held-back tokens, the older ones are final and released.
MAX_HELD_TOKENS = 8
REPLACEMENT = "\ufffd"


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
        self._skipped: frozenset[int] = frozenset(
            token_id
            for token_id, token in self._backend.get_added_tokens_decoder().items()
            if token.special and skip_special_tokens
        )
        # Decoding is piecewise at character boundaries (see the module docstring).
        self._piecewise = isinstance(self._backend.decoder, decoders.ByteLevel)
        context = [t for t in prompt_token_ids if t not in self._skipped]
        context = context[-PROMPT_CONTEXT_TOKENS:]
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT):
            context, context_text = [], ""  # the prompt ends inside a character: output
            # must not complete it
        self._ids: list[int] = context  # the decode window: ids[prefix:] are still needed
        self._prefix = 0  # ids[prefix:read] is decoded only as context
        self._read = len(context)  # ids[read:] is not emitted yet
        self._prefix_text: str | None = context_text  # decode(ids[prefix:read]), if known
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        text = "".join(self._chunks)
        self._chunks = [text]
        return text

    def add(self, token_id: int) -> str:
        """Appends one generated token; returns the text it finalizes (often "")."""
        if token_id in self._skipped:
            return ""  # the decoder never sees it, so dropping it changes nothing
        self._ids.append(token_id)
        prefix_text = self._window_prefix_text()
        new_text = self._decode(self._ids[self._prefix :])
        if new_text.endswith(REPLACEMENT):
            if len(self._ids) - self._read > MAX_HELD_TOKENS:
                return self._release_final_part(prefix_text, new_text)
            return ""  # maybe a character still incomplete
        if len(new_text) <= len(prefix_text):
            return ""  # nothing visible yet (keeps context for leading-space decoders)
        delta = new_text[len(prefix_text) :]
        whole = self._piecewise and REPLACEMENT not in new_text
        return self._emit(delta, len(self._ids), delta if whole else None)

    def finish(self) -> str:
        """Flushes what is held back (a trailing partial character decodes to U+FFFD)."""
        prefix_text = self._window_prefix_text()
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text):
            return ""
        return self._emit(new_text[len(prefix_text) :], len(self._ids))

    def _window_prefix_text(self) -> str:
        """decode(ids[prefix:read]): kept from the last delta where that is exact."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        return self._prefix_text

    def _emit(self, delta: str, read: int, delta_is_window_text: str | None = None) -> str:
        """Emits delta, the text of ids[read_before:read]; ids[old read:read] become context,
        whose text is ``delta_is_window_text`` when the caller knows it (else decoded later)."""
        self._prefix, self._read = self._read, read
        del self._ids[: self._prefix]  # keep the window small: only ids[prefix:] matter
        self._read -= self._prefix
        self._prefix = 0
        self._prefix_text = delta_is_window_text
        self._chunks.append(delta)
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
