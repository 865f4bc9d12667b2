"""An adapter's id is a hash of what it computes, so equal adapters share one id everywhere.

`adapter_id` = sha256 (full 64 lowercase hex digits) over a canonical serialization of the
normalized adapter: for each (layer, projection) present, in canonical order, its rank, its
scaling (exact, as float.hex) and the shapes and float32 little-endian bytes of A and B, then
for a DoRA module its magnitude's length and bytes, then each saved module copy
(modules_to_save: embed_tokens, lm_head) by name, shape and bytes, then trainable tokens' ids
(ascending) and rows. The last three are absent for plain LoRA, so plain ids are unchanged by
their arrival.
Consequences, on purpose:
- file layout does not matter: tensor order in the file, directory name, extra config fields
  (base_model_name_or_path, dropout, task_type, ...) and PEFT's module-name prefix are not
  hashed;
- storage dtype does not matter when values agree: an fp16 or bf16 file and the fp32 file of
  the same values (upcasting is exact) get the same id, since the served adapter is the same;
- anything that changes outputs changes the id: any weight value (even one ulp), a rank,
  a scaling, or the set of targeted modules. Two configs with the same scaling (alpha=16, r=4
  vs rslora alpha=8, r=4) compute the same thing and share an id.
The full digest is used, not a prefix: ids key a store shared across tenants and the KV
prefix cache, where a 64-bit prefix would make deliberate collisions (2^32 work) feasible.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeGuard

import numpy as np

from adapters.base_model import MODULE_PARENTS
from adapters.errors import InvalidAdapterIdError

if TYPE_CHECKING:
    from adapters.lora import LoraWeights
    from adapters.trainable_tokens import TrainableTokens

_DOMAIN = b"switchboard.lora-adapter.v1\n"
_ID = re.compile(r"[0-9a-f]{64}")
_MODULE_ORDER = {module: i for i, module in enumerate(MODULE_PARENTS)}


def canonical_order(key: tuple[int, str]) -> tuple[int, int]:
    """Sort key for (layer, module): by layer, then q, k, v, o, gate, up, down."""
    layer, module = key
    return layer, _MODULE_ORDER[module]


def compute_adapter_id(
    weights: Mapping[tuple[int, str], LoraWeights],
    saved: Mapping[str, np.ndarray] | None = None,  # module name → copy, in canonical order
    tokens: TrainableTokens | None = None,
) -> str:
    """sha256 over the canonical serialization described in the module docstring."""
    digest = hashlib.sha256(_DOMAIN)

    def update(fields: list, *arrays: np.ndarray) -> None:
        meta = json.dumps(fields).encode()
        digest.update(len(meta).to_bytes(4, "little"))
        digest.update(meta)
        # The shapes in `fields` fix how many bytes follow, so the stream is unambiguous.
        for array in arrays:
            digest.update(np.ascontiguousarray(array, dtype="<f4").tobytes())

    for layer, module in sorted(weights, key=canonical_order):
        w = weights[(layer, module)]
        fields = [layer, module, w.rank, list(w.a.shape), list(w.b.shape), float(w.scaling).hex()]
        if w.magnitude is None:
            update(fields, w.a, w.b)
        else:
            update([*fields, ["dora", len(w.magnitude)]], w.a, w.b, w.magnitude)
    for module, table in (saved or {}).items():
        update(["saved", module, list(table.shape)], table)
    if tokens is not None:
        update(["tokens", tokens.ids.tolist(), list(tokens.rows.shape)], tokens.rows)
    return digest.hexdigest()


def is_adapter_id(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def check_adapter_id(value: object) -> str:
    """Return `value` if it is a well-formed id; ids become path names, so nothing else passes."""
    if not is_adapter_id(value):
        raise InvalidAdapterIdError(
            f"adapter id {value!r} is not 64 lowercase hex digits", field="adapter_id"
        )
    return value
