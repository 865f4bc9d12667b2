"""Read a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) into a
validated, normalized `LoraAdapter`.

Order matters for safety and cost: the config and every shape/size/limit check run on the
safetensors header first, so an oversized or mismatched upload is refused before any tensor
is copied; pickled weights are refused by file name and never opened.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from adapters.base_model import PROJECTIONS, BaseModelSpec
from adapters.errors import InvalidAdapterError, UnsupportedAdapterFeatureError
from adapters.lora import LoraAdapter, LoraWeights
from adapters.peft_config import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    AdapterConfig,
    lora_scaling,
    parse_adapter_config,
)
from adapters.peft_experts import expert_modules, split_expert_tensors
from adapters.peft_names import WEIGHTS_FILE
from adapters.safetensors_io import TensorInfo, check_header_length, read_header, to_float32
from adapters.saved_modules import SAVED_MODULES, split_saved_tensors
from adapters.trainable_tokens import TrainableTokens, split_tokens_tensor
from adapters.validation import (
    ModuleTensors,
    check_against_base,
    check_against_config,
    check_finite,
    check_limits,
    check_no_head_targets,
    check_weight_file_size,
    pair_tensors,
)

# Weight files that torch.load would unpickle (arbitrary code execution). We never open them.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def load_adapter_dir(
    path: str | Path, *, base: BaseModelSpec, max_lora_rank: int, max_bytes: int
) -> LoraAdapter:
    """Load and validate the adapter in directory `path` (e.g. a `save_pretrained` output).

    `max_bytes` bounds both the weight file and its float32 normalized size.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise InvalidAdapterError(f"{directory} is not a directory")
    for entry in sorted(directory.iterdir()):
        if entry.name.lower().endswith(PICKLE_SUFFIXES):
            raise UnsupportedAdapterFeatureError(
                f"{entry.name}: pickled weights are refused (loading them can run arbitrary "
                f"code); save the adapter with safe_serialization=True ({WEIGHTS_FILE})",
                field=entry.name,
            )
    config_json = _read_file(directory / CONFIG_FILE, limit=MAX_CONFIG_BYTES)
    weights_path = directory / WEIGHTS_FILE
    if weights_path.is_file():
        size = weights_path.stat().st_size
        check_weight_file_size(size, max_bytes=max_bytes, what=WEIGHTS_FILE)
        with weights_path.open("rb") as f:  # the header's bound, before reading the file
            check_header_length(f.read(8), size, what=WEIGHTS_FILE)
    weights = _read_file(weights_path, limit=max_bytes)
    return parse_adapter(
        config_json, weights, base=base, max_lora_rank=max_lora_rank, max_bytes=max_bytes
    )


def parse_adapter(
    config_json: bytes | str,
    weights: bytes,
    *,
    base: BaseModelSpec,
    max_lora_rank: int,
    max_bytes: int,
) -> LoraAdapter:
    """Validate and normalize an adapter from its two files' contents (e.g. an upload)."""
    config = parse_adapter_config(config_json)
    check_no_head_targets(config)
    check_weight_file_size(len(weights), max_bytes=max_bytes, what=WEIGHTS_FILE)
    # One A and one B per projection, and room for stray tensors (biases, DoRA magnitudes)
    # so that their own refusals name them; the bound is on size, the checks on exactness.
    projections_per_layer = len(PROJECTIONS) + (2 if base.num_experts else 0)  # MoE: experts
    max_tensors = 4 * projections_per_layer * base.num_layers + len(SAVED_MODULES) + 1
    header = read_header(weights, what=WEIGHTS_FILE, max_tensors=max_tensors)
    tied = config.ensure_weight_tying and base.tie_word_embeddings
    if config.trainable_tokens and base.tie_word_embeddings and config.modules_to_save:
        raise UnsupportedAdapterFeatureError(
            "trainable_token_indices beside modules_to_save on a base with tied embeddings "
            "(both would change lm_head) is not served",
            field="trainable_token_indices",
        )
    tokens, rest = split_tokens_tensor(header, ids=config.trainable_tokens, base=base)
    saved, rest = split_saved_tensors(
        rest, listed=config.modules_to_save, tied=tied, config_file=CONFIG_FILE, base=base
    )
    projections, experts = split_expert_tensors(rest)
    modules = {}
    if projections or not experts:  # an adapter of experts alone has no projection tensors
        modules = pair_tensors(projections)
        check_against_base(modules, base)
        check_against_config(modules, config, base)
    modules.update(expert_modules(experts, base, config))
    extra = {**saved, **({"trainable_token_indices": tokens} if tokens else {})}
    check_limits(modules, max_lora_rank=max_lora_rank, max_bytes=max_bytes, saved=extra)
    return LoraAdapter(
        config,
        {key: _read_module(weights, m, config) for key, m in modules.items()},
        _read_saved(weights, saved, tied=tied),
        None if tokens is None else _read_tokens(weights, tokens, config.trainable_tokens),
    )


def _read_tokens(data: bytes, info: TensorInfo, ids: tuple[int, ...]) -> TrainableTokens:
    rows = to_float32(data, info)  # [n, hidden], in the order of ids
    check_finite(info.name, rows)
    return TrainableTokens.in_id_order(ids, rows)


def _read_saved(data: bytes, saved: dict[str, TensorInfo], *, tied: bool) -> dict[str, np.ndarray]:
    """The copies as float32; a tied pair is one copy serving both (from either in the file)."""
    tables = {}
    for module, info in saved.items():
        tables[module] = to_float32(data, info)  # [vocab, hidden]
        check_finite(info.name, tables[module])
    if tied and len(tables) == 2 and not np.array_equal(*tables.values()):
        raise InvalidAdapterError(
            "ensure_weight_tying ties embed_tokens and lm_head on this base, but the two saved "
            "copies differ",
            field="ensure_weight_tying",
        )
    if tied and tables:  # one array for both: counted and held once
        tables = dict.fromkeys(SAVED_MODULES, next(iter(tables.values())))
    return tables


def _read_module(data: bytes, m: ModuleTensors, config: AdapterConfig) -> LoraWeights:
    a = to_float32(data, m.a)  # [r, in]
    b = to_float32(data, m.b)  # [out, r]
    check_finite(m.a.name, a)
    check_finite(m.b.name, b)
    magnitude = None
    if m.magnitude is not None:
        magnitude = to_float32(data, m.magnitude)  # [out]
        check_finite(m.magnitude.name, magnitude)
    alpha = config.alpha_for(m.key)
    scaling = lora_scaling(rank=m.rank, alpha=alpha, use_rslora=config.use_rslora)
    return LoraWeights(
        a=a, b=b, scaling=scaling, alpha=alpha, magnitude=magnitude, experts=m.experts
    )


def _read_file(path: Path, *, limit: int) -> bytes:
    """Read at most `limit` bytes, refusing a missing or longer file (no unbounded reads)."""
    if not path.is_file():
        raise InvalidAdapterError(f"{path.name} is missing from {path.parent}", field=path.name)
    with path.open("rb") as f:
        # read(n) allocates n bytes up front: ask for what the file holds, not the limit.
        data = f.read(min(limit, os.fstat(f.fileno()).st_size) + 1)
    if len(data) > limit:
        raise InvalidAdapterError(f"{path.name} is over {limit} bytes", field=path.name)
    return data
