"""Errors the engine raises for bad requests; the gateway maps them to OpenAI error bodies."""


class EngineError(Exception):
    """Base class for every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong (bad parameters, too long, unknown tokens); HTTP 400."""


class RequestTooLargeError(InvalidRequestError):
    """The request can never fit in the KV cache, however empty it is."""


class ModelLoadError(EngineError):
    """A checkpoint is missing, unreadable, or not of the Llama family."""


class SpeculativeConfigError(EngineError, ValueError):
    """Speculative decoding is misconfigured: bad k, or a draft model the target can't use."""
