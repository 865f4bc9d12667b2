"""A checkpoint's safetensors shards read into tensors: floating ones cast to the model's dtype,
slices read where a tensor-parallel rank needs only its shard, and a published quantized
checkpoint's packed tensors turned into ``QuantizedWeight``s by its format's reader; then put on
the device the model runs on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from switchboard_kernels.quantized_weight import QuantizedWeight
from worker.errors import ModelLoadError
from worker.model.model_config import ModelConfig
from worker.model.quantized_checkpoints import (
    Reader,
    is_quantized_tensor,
    on_device,
    read_quantized,
    shard_quantized,
)
from worker.model.sharding import Shard, Span, check_divisible, weight_slicer


def load_weights(
    path: Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    shard: Shard | None,
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """The checkpoint's tensors on ``device``; with ``shard``, this tensor-parallel rank's
    shard only (each tensor's slice read from the file)."""
    select = None
    if shard is not None:
        check_divisible(config, shard.size)
        select = weight_slicer(config, shard)
    loaded = load_safetensors(path, dtype, select=select, quantization=config.quantization)
    return {k: on_device(v, device) for k, v in loaded.items()}


def load_safetensors(
    path: Path,
    dtype: torch.dtype,
    *,
    select: Callable[[str], tuple[int, Span] | None] | None = None,
    quantization: Reader | None = None,
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every tensor of every ``*.safetensors`` shard in ``path``, floating ones cast to ``dtype``.
    ``select``: for a name, the (dim, span) of it to read (None: all of it; several slices:
    stacked along ``dim``). ``quantization``: the checkpoint's reader; each quantized module's
    tensors are read whole and as stored, then replaced by its ``QuantizedWeight`` (sliced
    after, under ``select``) under ``module.weight``."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path} (pickled weights are refused)")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if quantization is not None and is_quantized_tensor(name, quantization):
                    weights[name] = f.get_tensor(name)
                    continue
                part = select(name) if select is not None else None
                if part is None:
                    tensor = f.get_tensor(name)
                else:
                    dim, span = part
                    sliced = f.get_slice(name)
                    pieces = [
                        sliced[(slice(None),) * dim + (s,)]
                        for s in (span if isinstance(span, tuple) else (span,))
                    ]
                    tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)
                weights[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    if "model.embed_tokens.weight" not in weights:
        raise ModelLoadError(f"{path} has no model.embed_tokens.weight: not a Llama checkpoint")
    if quantization is None:
        return weights
    read = read_quantized(weights, quantization)
    if select is not None:
        for name, w in read.items():
            if isinstance(w, QuantizedWeight) and (part := select(name)) is not None:
                read[name] = shard_quantized(w, name, *part)
    return read
