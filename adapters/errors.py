"""Why an adapter was refused: one exception type per kind of refusal.

The gateway maps these once, at the edge, to OpenAI-style error bodies: everything here is a
client error (HTTP 400), except `AdapterNotFoundError` (404) and `AdapterTooLargeError` (413).
"""

from __future__ import annotations


class AdapterError(ValueError):
    """Base of every adapter refusal; `field` names the config field or tensor at fault."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidAdapterError(AdapterError):
    """The files are not a well-formed PEFT LoRA adapter (bad JSON, bad header, NaN, ...)."""


class UnsupportedAdapterFeatureError(AdapterError):
    """A well-formed adapter that uses a feature we do not serve (DoRA, pickles, lm_head, ...)."""


class IncompatibleAdapterError(AdapterError):
    """A well-formed adapter made for another base model (unknown module, layer, or shape)."""


class AdapterTooLargeError(AdapterError):
    """The adapter exceeds a deployment limit (`max_lora_rank` or the byte bound)."""


class UnsafeArchiveError(AdapterError):
    """An uploaded archive tried something hostile: traversal, links, devices, pickles."""


class InvalidAdapterIdError(AdapterError):
    """An adapter id that is not 64 lowercase hex digits (so it can never name a path)."""


class AdapterNotFoundError(AdapterError):
    """No adapter with this id is in the store."""
