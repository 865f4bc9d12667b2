"""Quantized checkpoints as published: GPTQ, AWQ (GEMM) and compressed-tensors (pack-quantized),
each projection's packed tensors read into a ``QuantizedWeight``
(``switchboard_kernels.quantized_weight``) without quantizing anything again.

``checkpoint_reader`` reads ``quantization_config`` and picks the format's reader, or refuses the
checkpoint by its method's name (bitsandbytes, FP8, HQQ, ...) or by the option of a served method
that we cannot serve exactly. ``read_quantized`` then replaces each quantized projection's tensors
in a loaded weights dict by its ``QuantizedWeight``, under the projection's plain name
(``...q_proj.weight``), where the model loader looks for a weight.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from switchboard_kernels.quantized_weight import QuantizedWeight, cat_rows
from worker.errors import ModelLoadError, TensorParallelConfigError
from worker.model.quantized_checkpoints.awq import AwqReader
from worker.model.quantized_checkpoints.compressed_tensors import CompressedTensorsReader
from worker.model.quantized_checkpoints.gptq import GptqReader


class Reader(Protocol):
    method: ClassVar[str]
    tensor_names: ClassVar[tuple[str, ...]]  # a quantized module's tensors, by last name

    def read(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight: ...


READERS: dict[str, type] = {
    "gptq": GptqReader,
    "awq": AwqReader,
    "compressed-tensors": CompressedTensorsReader,
}
# Modules served unquantized only: the embedding is a gather, the output layer's fp32 logits come
# from its own kernels (docs/quantization.md).
UNQUANTIZED = ("model.embed_tokens", "lm_head")


def checkpoint_reader(hf_config) -> Reader | None:
    """The reader of a checkpoint's ``quantization_config`` (None: not quantized), or a
    ``ModelLoadError`` naming the method or option not served."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    method = str(config.get("quant_method") or "unknown").lower()
    if method not in READERS:
        raise ModelLoadError(
            f"quantized checkpoints of method {method!r} are not served (served: "
            f"{', '.join(READERS)}; or serve its bf16 or fp32 original)"
        )
    return READERS[method].from_config(config)


def is_quantized_tensor(name: str, reader: Reader) -> bool:
    """Whether checkpoint tensor ``name`` is part of a quantized module (read uncast, whole)."""
    return name.rsplit(".", 1)[-1] in reader.tensor_names


def read_quantized(
    weights: dict[str, torch.Tensor], reader: Reader
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """``weights`` with each quantized module's tensors replaced by ``module.weight``, its
    ``QuantizedWeight``; the other tensors as they are."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, t in weights.items():
        if is_quantized_tensor(name, reader):
            module, last = name.rsplit(".", 1)
            modules.setdefault(module, {})[last] = t
        else:
            out[name] = t
    for module, tensors in modules.items():
        if module in UNQUANTIZED:
            raise ModelLoadError(f"a quantized {module} is not served ({reader.method})")
        if f"{module}.weight" in out:
            raise ModelLoadError(f"{module} has both a weight and {reader.method} tensors")
        try:
            out[f"{module}.weight"] = reader.read(module, tensors)
        except ValueError as e:  # QuantizedWeight's own checks
            raise ModelLoadError(f"{module}: {e}") from None
    return out


def on_device(w: torch.Tensor | QuantizedWeight, device: torch.device | str):
    """A loaded weight on ``device``."""
    if not isinstance(w, QuantizedWeight):
        return w.to(device)
    order = None if w.input_order is None else w.input_order.to(device)
    moved = (t.to(device) for t in (w.levels, w.scales, w.zeros))
    return QuantizedWeight(*moved, w.bits, w.group_size, order)


def shard_quantized(w: QuantizedWeight, name: str, dim: int, span) -> QuantizedWeight:
    """This rank's part of a quantized projection (``worker.model.sharding.weight_slicer``'s
    (dim, span) for ``name``): output rows (several spans: a fused tensor's parts), or input
    columns in whole groups; an act-order weight's columns are refused."""
    spans = span if isinstance(span, tuple) else (span,)
    if dim == 0:
        parts = [w.rows(s.start, s.stop) for s in spans]
        return parts[0] if len(parts) == 1 else cat_rows(parts)
    if dim == 1 and len(spans) == 1:
        start, stop = spans[0].start, spans[0].stop
        if w.group_size == w.shape[1] and w.input_order is None:  # per channel: any columns
            levels = w.levels[:, start:stop].contiguous()
            return QuantizedWeight(levels, w.scales, w.zeros, w.bits, stop - start)
        try:
            return w.columns(start, stop)
        except ValueError as e:
            raise TensorParallelConfigError(
                f"{name} cannot be split by input features under tensor parallelism: {e}"
            ) from None
    raise TensorParallelConfigError(f"{name}: a quantized weight is not split along dim {dim}")
