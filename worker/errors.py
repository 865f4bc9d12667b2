"""Errors the engine raises for bad requests, and for a request that failed a step alone;
the servicer maps them to gRPC codes (`status_for`), the gateway to OpenAI error bodies."""


class EngineError(Exception):
    """Base class for every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong (bad parameters, too long, unknown tokens); HTTP 400."""


class RequestTooLargeError(InvalidRequestError):
    """The request can never fit in the KV cache, however empty it is."""


class UnknownAdapterError(InvalidRequestError):
    """A request named an adapter that is not loaded."""


class ModelLoadError(EngineError):
    """A checkpoint is missing, unreadable, or not of the Llama family."""


class SpeculativeConfigError(EngineError, ValueError):
    """Speculative decoding is misconfigured: bad k, or a draft model the target can't use."""


class SequenceFailedError(EngineError):
    """A step failed for this request alone (found by running its parts apart); the engine
    ended it and went on with the others. Not the worker's fault: no other worker should
    be asked to run it again."""


class StructuredOutputError(InvalidRequestError):
    """A request's grammar failed while it generated (its parser's work bounds ran out):
    the request ends alone; its grammar, not the worker, is at fault."""


class NonFiniteLogitsError(InvalidRequestError):
    """The model gave this request no logits to sample from (NaN, or all -inf): its adapter
    or its values broke the numbers; the request ends alone."""


class TensorParallelConfigError(EngineError, ValueError):
    """The model cannot be split over ``tensor_parallel_size`` ranks (a head count, the
    hidden or the intermediate size that does not divide), or the group cannot be set up."""


class TensorParallelError(EngineError):
    """The tensor-parallel group failed: a rank died or a collective broke. The ranks are
    out of step, so the engine serves no more (the worker exits and is restarted)."""


class WorkerStartupError(EngineError):
    """The worker cannot start as configured (a port it must bind is taken): it stops
    before it loads the model or announces itself."""
