"""Where and in what precision an engine runs: the names users give, checked once."""

from __future__ import annotations

import torch

from worker.errors import InvalidRequestError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    """``cpu`` or ``cuda`` (``cuda:N``); CUDA must be usable in this process."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidRequestError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError(
            f"device {device!r} needs CUDA, which this torch build or machine does not have"
        )
    return resolved


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InvalidRequestError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]
