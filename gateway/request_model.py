"""The base of every OpenAI request body the gateway parses, and its one rule about `null`.

OpenAI treats `null` as "use the default" for every optional field, and the official SDK
sends `None` arguments as JSON `null`: so, before validation, a `null` given for a field
that has a default is dropped and the field takes its default. A required field (`model`,
`prompt`, `messages`, ...) stays required: `null` there is a schema violation (400).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, model_validator

# The most items a body's lists (messages, input items, tools) may hold when parsed. Their
# items are validated on the event loop (tens of µs each, more on a busy machine), and pydantic
# checks a list's length only after validating every item: 100,000 messages held the loop for
# seconds. `at_most` refuses a longer list by its length first.
MAX_PARSED_ITEMS = 4096


class RequestModel(BaseModel):
    """A request body (or a part of one): unknown fields ignored, as vLLM does; NaN and
    infinity refused; `null` for an optional field is its default."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = _optional_keys(cls)
        return {k: v for k, v in data.items() if v is not None or k not in optional}


_OPTIONAL: dict[type, frozenset[str]] = {}


def _optional_keys(model: type[BaseModel]) -> frozenset[str]:
    """The names (and aliases) of ``model``'s fields that have a default."""
    keys = _OPTIONAL.get(model)
    if keys is None:
        keys = frozenset(
            key
            for name, info in model.model_fields.items()
            if not info.is_required()
            for key in (name, info.alias)
            if key is not None
        )
        _OPTIONAL[model] = keys
    return keys


def at_most(limit: int) -> BeforeValidator:
    """For `Annotated[...]`: a list or map longer than ``limit`` is refused (naming the field)
    before any of its items is validated."""

    def check(value: Any) -> Any:
        if isinstance(value, list | dict) and len(value) > limit:
            raise ValueError(f"at most {limit} items are allowed, got {len(value)}")
        return value

    return BeforeValidator(check)
