"""PEFT's trainable tokens (`trainable_token_indices`): new embedding rows for a few token ids.

PEFT saves the rows as `base_model.model.model.embed_tokens.token_adapter.
trainable_tokens_delta` ([n, hidden], in the order of the config's ids: a list, or
`{"embed_tokens": [...]}`). At inference a row using the adapter embeds those ids with the saved
rows (they replace the base rows, whatever the name says), and on a base with tied embeddings the
output layer's columns of those ids use them too (PEFT wraps the tied `lm_head` with the same
rows). Only the input embedding is served as a target; the ids must be distinct and inside the
vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from adapters.base_model import BaseModelSpec
from adapters.errors import (
    IncompatibleAdapterError,
    InvalidAdapterError,
    UnsupportedAdapterFeatureError,
)
from adapters.peft_names import PEFT_PREFIX
from adapters.safetensors_io import TensorInfo

FIELD = "trainable_token_indices"
TOKENS_TENSOR = f"{PEFT_PREFIX}model.embed_tokens.token_adapter.trainable_tokens_delta"
_TENSOR_NAMES = {TOKENS_TENSOR, f"{PEFT_PREFIX}embed_tokens.token_adapter.trainable_tokens_delta"}
_EMBEDDING_NAMES = ("embed_tokens", "model.embed_tokens")
MAX_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class TrainableTokens:
    """The replaced embedding rows, by token id ascending. Arrays are read-only."""

    ids: np.ndarray  # [n] int64, distinct, ascending
    rows: np.ndarray  # [n, hidden] float32

    def __post_init__(self) -> None:
        if self.ids.dtype != np.int64 or self.rows.dtype != np.float32:
            raise TypeError(
                f"TrainableTokens needs int64 ids and float32 rows, got {self.ids.dtype}"
            )
        if self.rows.ndim != 2 or self.ids.shape != (self.rows.shape[0],):
            raise ValueError(f"token ids {self.ids.shape} do not fit rows {self.rows.shape}")
        self.ids.flags.writeable = False
        self.rows.flags.writeable = False

    @classmethod
    def in_id_order(cls, ids: tuple[int, ...], rows: np.ndarray) -> TrainableTokens:
        """From the config's ids and the file's rows in that order."""
        order = np.argsort(np.asarray(ids, dtype=np.int64), kind="stable")
        return cls(np.asarray(ids, dtype=np.int64)[order], np.ascontiguousarray(rows[order]))

    @property
    def num_bytes(self) -> int:
        return int(self.ids.nbytes + self.rows.nbytes)


def trainable_token_ids(value: Any, *, config_file: str) -> tuple[int, ...]:
    """`trainable_token_indices` as the ids it gives the input embedding, in the file's order."""
    if value is None or value == [] or value == {}:
        return ()
    if isinstance(value, dict):
        others = [k for k in value if k not in _EMBEDDING_NAMES]
        if others:
            raise UnsupportedAdapterFeatureError(
                f"{config_file}: {FIELD} targets {str(others[0])[:100]!r}; only the input "
                "embedding (embed_tokens) is served",
                field=FIELD,
            )
        if len(value) != 1:
            raise InvalidAdapterError(
                f"{config_file}: {FIELD} names embed_tokens twice", field=FIELD
            )
        value = next(iter(value.values()))
    if (
        not isinstance(value, list)
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        or len(value) > MAX_TOKENS
    ):
        raise InvalidAdapterError(
            f"{config_file}: {FIELD} must be a list of at most {MAX_TOKENS} token ids (or "
            f"{{'embed_tokens': [...]}}), got {str(value)[:200]}",
            field=FIELD,
        )
    if len(set(value)) != len(value):
        raise InvalidAdapterError(
            f"{config_file}: {FIELD} lists a token id twice (PEFT would keep either row)",
            field=FIELD,
        )
    return tuple(value)


def split_tokens_tensor(
    tensors: Mapping[str, TensorInfo], *, ids: tuple[int, ...], base: BaseModelSpec
) -> tuple[TensorInfo | None, dict[str, TensorInfo]]:
    """(the rows' tensor, or None without trainable tokens; the other tensors). The rows are
    [len(ids), hidden], present exactly when the config lists ids, each id inside the vocabulary."""
    found = [name for name in tensors if name in _TENSOR_NAMES]
    rest = {name: info for name, info in tensors.items() if name not in _TENSOR_NAMES}
    if len(found) > 1:
        raise InvalidAdapterError(f"tensors {found[0]!r} and {found[1]!r} both hold token rows")
    info = tensors[found[0]] if found else None
    if info is None:
        if ids:
            raise InvalidAdapterError(
                f"adapter_config.json sets {FIELD} but the weights have no {TOKENS_TENSOR}",
                field=FIELD,
            )
        return None, rest
    if not ids:
        raise InvalidAdapterError(
            f"tensor {info.name!r} holds trainable token rows but adapter_config.json sets no "
            f"{FIELD}",
            field=info.name,
        )
    if info.shape != (len(ids), base.hidden_size):
        raise IncompatibleAdapterError(
            f"tensor {info.name!r} has shape {list(info.shape)}, expected "
            f"{[len(ids), base.hidden_size]} ({FIELD} × hidden of this base model)",
            field=info.name,
        )
    outside = [i for i in ids if i >= base.vocab_size]
    if outside:
        raise IncompatibleAdapterError(
            f"{FIELD} holds token id {outside[0]}, outside this base model's vocabulary of "
            f"{base.vocab_size}",
            field=FIELD,
        )
    return info, rest
