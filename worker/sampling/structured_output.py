"""What a request's output must match, as the caller says it (``worker.sampling.grammar``
compiles it). Light: no torch, llguidance only when the grammar is built."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

from runtime.grammar_bounds import JSON_STYLE, MAX_GRAMMAR_BYTES
from worker.errors import InvalidRequestError

# Grammar text the worker compiles at most (characters: a UTF-8 byte is at most one).
MAX_GRAMMAR_CHARS = MAX_GRAMMAR_BYTES


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What the output must match. ``format``: "json_schema" (``text`` a JSON schema),
    "json_object" (any JSON object; ``text`` empty), "regex", "choice" (``text`` a JSON list
    of strings), "lark" (llguidance's Lark dialect; it embeds JSON schemas as ``%json``),
    or "gbnf" (llama.cpp's grammars)."""

    format: str
    text: str = ""

    FORMATS: ClassVar[tuple[str, ...]] = (
        "json_schema",
        "json_object",
        "regex",
        "choice",
        "lark",
        "gbnf",
    )

    def __post_init__(self) -> None:
        if self.format not in self.FORMATS:
            raise InvalidRequestError(
                f"structured output format must be one of {', '.join(self.FORMATS)}, "
                f"got {self.format!r}"
            )
        if not isinstance(self.text, str) or len(self.text) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(
                f"a structured output's grammar must be text of at most {MAX_GRAMMAR_CHARS} "
                "characters"
            )
        if self.format != "json_object" and not self.text:
            raise InvalidRequestError(f"a {self.format} structured output needs its text")

    @classmethod
    def json_schema(cls, schema: str | dict) -> StructuredOutput:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def lark(cls, grammar: str) -> StructuredOutput:
        return cls("lark", grammar)

    def grammar(self) -> str:
        """The llguidance grammar this stands for (not yet checked)."""
        import llguidance

        try:
            if self.format in ("json_schema", "json_object"):
                schema = self.text if self.format == "json_schema" else '{"type": "object"}'
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
            return llguidance.grammar_from(self.format, self.text)  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"invalid {self.format} structured output: {exc}") from exc
