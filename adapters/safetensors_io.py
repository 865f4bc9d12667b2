"""A strict safetensors reader that yields float32 numpy arrays, bfloat16 included.

Why by hand: numpy has no bfloat16, and both `safetensors.numpy.load` and
`safe_open(..., framework="numpy")` raise `TypeError: data type 'bfloat16' not understood` on
bf16 files (checked with safetensors 0.8 / numpy 2.4), while the alternative frameworks import
torch, which the gateway must not. The format is small and documented
(https://github.com/huggingface/safetensors#format): an 8-byte little-endian header length N,
N bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the raw little-endian byte buffer, which the tensors must cover exactly, without holes.
Parsing the header first also lets callers bound sizes before any tensor is materialized.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from safetensors.numpy import save

from adapters.errors import InvalidAdapterError, UnsupportedAdapterFeatureError

# Accepted dtypes → bytes per element. BF16 is read as uint16 and widened by hand.
ITEM_SIZES: dict[str, int] = {"F32": 4, "F16": 2, "BF16": 2}
# A LoRA header is ~150 bytes a tensor: 1 MiB holds ~7,000 tensors, over twice the 1,764 of a
# 126-layer model with all seven projections. Checked on the 8-byte prefix, before anything
# is read or parsed (the safetensors library allows 100 MB, which json expands ~10x).
MAX_HEADER_BYTES = 1 << 20
MAX_DIMS = 8


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lives in the file; offsets are absolute within the file's bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)


def check_header_length(prefix: bytes, file_len: int, *, what: str) -> int:
    """The header length from the file's first 8 bytes, refused past the bound or the file."""
    if len(prefix) < 8:
        raise InvalidAdapterError(f"{what}: file is {file_len} bytes, shorter than its header")
    header_len = int.from_bytes(prefix[:8], "little")
    if header_len > MAX_HEADER_BYTES:
        raise InvalidAdapterError(
            f"{what}: header length {header_len} is over the limit of {MAX_HEADER_BYTES} bytes"
        )
    if header_len > file_len - 8:
        raise InvalidAdapterError(
            f"{what}: header length {header_len} exceeds the file ({file_len} bytes)"
        )
    return header_len


def read_header(
    data: bytes, *, what: str = "adapter_model.safetensors", max_tensors: int | None = None
) -> dict[str, TensorInfo]:
    """Parse and check the header: dtypes, shapes, offsets in bounds, buffer covered exactly.
    `max_tensors` bounds the entries (the base model's layers x projections x 2)."""
    header_len = check_header_length(data[:8], len(data), what=what)
    try:
        raw = json.loads(data[8 : 8 + header_len], object_pairs_hook=_no_duplicate_keys)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidAdapterError(f"{what}: header is not valid JSON ({exc})") from exc
    except RecursionError as exc:
        raise InvalidAdapterError(f"{what}: header JSON is nested too deeply") from exc
    if not isinstance(raw, dict):
        raise InvalidAdapterError(f"{what}: header is not a JSON object")
    raw.pop("__metadata__", None)
    if max_tensors is not None and len(raw) > max_tensors:
        raise InvalidAdapterError(
            f"{what}: header lists {len(raw)} tensors; a LoRA of this base model has at most "
            f"{max_tensors}"
        )
    buffer_start = 8 + header_len
    tensors = {name: _tensor_info(name, entry, buffer_start, what) for name, entry in raw.items()}
    _check_buffer_covered(tensors, buffer_start, len(data), what)
    return tensors


def to_float32(data: bytes, info: TensorInfo) -> np.ndarray:
    """Copy one tensor out of the file's bytes as a C-contiguous float32 array."""
    count = info.num_elements
    if info.dtype == "F32":
        array = np.frombuffer(data, dtype="<f4", count=count, offset=info.start).astype(np.float32)
    elif info.dtype == "F16":
        array = np.frombuffer(data, dtype="<f2", count=count, offset=info.start).astype(np.float32)
    else:
        # bfloat16 is the top half of a float32: widen to uint32 and shift into place (exact).
        halves = np.frombuffer(data, dtype="<u2", count=count, offset=info.start)
        array = (halves.astype(np.uint32) << 16).view(np.float32)
    return array.reshape(info.shape)


def write_float32(tensors: Mapping[str, np.ndarray]) -> bytes:
    """Serialize float32 arrays as safetensors bytes (tensor order is the library's: sorted)."""
    return save({name: np.ascontiguousarray(t, dtype=np.float32) for name, t in tensors.items()})


def _tensor_info(name: str, entry: object, buffer_start: int, what: str) -> TensorInfo:
    if not isinstance(entry, dict):
        raise InvalidAdapterError(f"{what}: header entry for {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in ITEM_SIZES:
        raise UnsupportedAdapterFeatureError(
            f"{what}: tensor {name!r} has dtype {dtype!r}; only F32, F16 and BF16 are served",
            field=name,
        )
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(map(_is_uint, shape)):
        raise InvalidAdapterError(f"{what}: tensor {name!r} has a malformed shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_uint, offsets))):
        raise InvalidAdapterError(f"{what}: tensor {name!r} has malformed data_offsets {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * ITEM_SIZES[dtype]
    if end - begin != expected:
        raise InvalidAdapterError(
            f"{what}: tensor {name!r} ({dtype} {shape}) needs {expected} bytes, "
            f"data_offsets span {end - begin}"
        )
    return TensorInfo(name, dtype, tuple(shape), buffer_start + begin, buffer_start + end)


def _check_buffer_covered(
    tensors: Mapping[str, TensorInfo], buffer_start: int, file_len: int, what: str
) -> None:
    """Tensors must tile the byte buffer exactly, as the safetensors library itself requires."""
    position = buffer_start
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if info.start != position:
            raise InvalidAdapterError(
                f"{what}: tensor {info.name!r} starts at byte {info.start - buffer_start} of the "
                f"buffer, expected {position - buffer_start} (overlap or hole)"
            )
        position = info.end
    if position != file_len:
        raise InvalidAdapterError(
            f"{what}: tensors cover {position - buffer_start} bytes of a "
            f"{file_len - buffer_start}-byte buffer"
        )


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result
