"""Incremental detokenization for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2, SmolLM2),
without a decode call per token.

There, a token is a fixed string of bytes and ``decode(ids)`` is those bytes, back to back,
read as UTF-8 with U+FFFD for what is not (Rust's ``from_utf8_lossy``). So each token's bytes
are looked up once per tokenizer (`token_bytes`) and fed to the standard library's
incremental UTF-8 decoder, which holds back an incomplete character's bytes and replaces
invalid ones as a whole decode would (the same maximal-subpart rule). Why not the library's
own decode, as `worker.text.detokenizer` does for other tokenizers: through PyO3 each call
costs more than the rest of a token's postprocessing, and a step decodes one per sequence
(bench/host_step.py). The tests hold the table to ``tokenizer.decode`` for every id.
"""

from __future__ import annotations

import codecs
import functools
from typing import Any

from tokenizers import decoders


@functools.cache
def _char_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable bytes stand for themselves, the
    others for chr(256 + n) in order (tokenizers' ``ByteLevel`` decoder reads it so)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {byte: chr(byte) for byte in printable}
    others = [byte for byte in range(256) if byte not in chars]
    chars |= {byte: chr(256 + n) for n, byte in enumerate(others)}
    return {char: byte for byte, char in chars.items()}


def _bytes_of(token: str, char_bytes: dict[str, int]) -> bytes:
    """A token's bytes as the ByteLevel decoder gives them: each character's byte, or, if a
    character is outside the alphabet (an added token such as "<tool call>"), the token's
    own UTF-8."""
    try:
        return bytes(char_bytes[c] for c in token)
    except KeyError:
        return token.encode()


@functools.cache
def token_bytes(backend: Any) -> tuple[bytes, ...] | None:
    """Every id's bytes for a ``tokenizers.Tokenizer`` whose decoder is byte-level alone,
    ids the tokenizer does not know as b"" (decode skips them); None for other decoders."""
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    table = [b""] * (max(vocab.values(), default=-1) + 1)
    char_bytes = _char_bytes()
    for token, token_id in vocab.items():
        table[token_id] = _bytes_of(token, char_bytes)
    return tuple(table)


class ByteLevelDetokenizer:
    """``IncrementalDetokenizer``'s contract for a byte-level tokenizer: the deltas add up
    to ``tokenizer.decode(output_ids, skip_special_tokens=...)``. A prompt ending inside a
    character is not completed by the output (decoding starts afresh)."""

    def __init__(self, table: tuple[bytes, ...], skipped: frozenset[int]) -> None:
        self._table = table
        self._skipped = skipped  # special tokens, when they are skipped
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int) -> str:
        """Appends one generated token; returns the text it completes (often all of it)."""
        if token_id in self._skipped or not 0 <= token_id < len(self._table):
            return ""
        return self._utf8.decode(self._table[token_id])

    def finish(self) -> str:
        """Flushes an incomplete character's bytes (as U+FFFD)."""
        return self._utf8.decode(b"", final=True)
