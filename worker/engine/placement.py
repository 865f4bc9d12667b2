"""Where and in what precision an engine runs: the names users give, checked once."""

from __future__ import annotations

import importlib.util
import os

import torch

from switchboard_kernels.linear import native_bf16
from worker.errors import InvalidRequestError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)


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


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """A name from ``DTYPE_CHOICES`` (or a torch dtype) as the dtype the engine runs in.

    ``auto`` is bf16 wherever its matmuls are native (GPUs with bf16, CPUs whose oneDNN has
    a bf16 path: AVX512-BW or AVX-NE-CONVERT and up), fp16 on older GPUs, and fp32 on
    AVX2-only CPUs: there oneDNN's bf16 matmuls ran 5-9x slower than fp32 from 4 tokens up,
    and with our kernel's AVX2 path bf16 runs 1.4-1.5x fp32 at batch 1 but 0.90-1.00x at
    batch 8 and 0.81-0.90x at 32 (prefill chunks cost more in it), so bf16 stays an
    explicit choice there (``bench.bf16_projections --against float32``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device is not None and device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if native_bf16() else torch.float32
    if dtype not in DTYPES:
        raise InvalidRequestError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_attention_backend(backend: str | None, device: torch.device) -> str:
    """``triton`` or ``torch``; None picks triton on CUDA (where triton is installed).

    Triton needs the package, and on CPU its interpreter (``TRITON_INTERPRET=1``, for
    tests: compiled kernels cannot launch without a GPU)."""
    has_triton = importlib.util.find_spec("triton") is not None
    if backend is None:
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if backend == "triton":
        if not has_triton:
            raise InvalidRequestError("attention_backend='triton' needs the triton package")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise InvalidRequestError(
                "attention_backend='triton' on device 'cpu' runs only in Triton's interpreter "
                "(TRITON_INTERPRET=1, for tests); use 'torch' on CPU"
            )
    return backend


def resolve_cuda_graphs(
    requested: bool | None,
    device: torch.device,
    attention_backend: str,
    tensor_parallel_size: int,
    *,
    sparse_experts: bool = False,
) -> bool:
    """Decode steps as CUDA graphs: on CUDA with the triton backend on one rank, for a dense
    model (None: there by default); asking for them anywhere else is refused. A MoE model's
    grouping by expert reads the routing on the host, which a graph cannot replay."""
    possible = device.type == "cuda" and attention_backend == "triton" and tensor_parallel_size == 1
    if requested and not possible:
        raise InvalidRequestError(
            "cuda_graphs needs device 'cuda', attention_backend 'triton' and one rank "
            f"(got {device.type!r}, {attention_backend!r}, {tensor_parallel_size} ranks)"
        )
    if requested and sparse_experts:
        raise InvalidRequestError("cuda_graphs is not supported for mixture-of-experts models")
    possible = possible and not sparse_experts
    return possible if requested is None else requested


def resolve_async_output(requested: bool | None, device: torch.device, speculative: bool) -> bool:
    """Render a step's tokens while the device runs the next one: where the device runs
    apart from the host (None: on CUDA), and never beside speculation, whose verified
    drafts end a step with several tokens a stop string may cut."""
    if requested and speculative:
        raise InvalidRequestError("async_output needs speculative decoding off")
    if requested is None:
        return device.type == "cuda" and not speculative
    return requested
