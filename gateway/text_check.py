"""Strings checked once, at the edge: a request whose text holds invalid Unicode is a 400 naming
the field, before any stage reads it.

JSON can carry what no UTF-8 text holds: a lone UTF-16 surrogate, written `\\ud800` (or sent
as the bytes ED A0 80, which Python's JSON parser passes through). Such a string cannot be
tokenized, encoded into a protobuf or written to Redis, so each of those would fail later with
a 500. Every string of the body is checked here instead, map keys included, and the first bad
one is named by its path (`messages.2.content`, `tools.0.function.description`).

The body's raw bytes decide whether the walk is needed at all: a UTF-8 body with neither a
`\\u` escape nor the byte ED holds no surrogate, which two byte scans tell (about a
millisecond for 4 MiB); only a body with escapes is searched for a surrogate's escape, and
only a body with one is walked.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel

from gateway.errors import InvalidRequestError

# A UTF-16 surrogate's escape (\uD800-\uDFFF, either case), or its 3 bytes in "UTF-8" (ED A0-BF).
SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def check_text(body: BaseModel, raw: bytes | None = None) -> None:
    """A 400 naming the first string of ``body`` (parsed from ``raw``, when given) that is not
    valid Unicode."""
    if raw is not None and not _may_hold_surrogates(raw):
        return
    path = _first_invalid(body, ())
    if path is not None:
        field = ".".join(str(part) for part in path) or None
        raise InvalidRequestError(
            f"{field or 'the body'} is not valid Unicode: it holds a lone UTF-16 surrogate "
            "(\\ud800-\\udfff), which no UTF-8 text can carry",
            param=field,
        )


def _may_hold_surrogates(raw: bytes) -> bool:
    if json.detect_encoding(raw) != "utf-8":
        return True  # UTF-16 or UTF-32 JSON: walk it
    if b"\\u" not in raw and b"\xed" not in raw:
        return False
    return SURROGATE.search(raw) is not None


def _first_invalid(value: Any, path: tuple[str | int, ...]) -> tuple[str | int, ...] | None:
    """The path of the first string under ``value`` that does not encode to UTF-8."""
    if isinstance(value, str):
        return None if _valid(value) else path
    if isinstance(value, BaseModel):
        for name, info in type(value).model_fields.items():
            found = _first_invalid(getattr(value, name), (*path, info.alias or name))
            if found is not None:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not _valid(key):
                return path
            found = _first_invalid(item, (*path, key))
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _first_invalid(item, (*path, index))
            if found is not None:
                return found
    return None


def _valid(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
