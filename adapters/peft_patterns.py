"""PEFT's rules for which modules an adapter config selects, and with which rank and alpha.

Mirrors peft 0.21 exactly, so an adapter means here what it means in `PeftModel`:
- `target_selected` is `peft.tuners.tuners_utils.check_target_module_exists` (without the
  `modules_to_save` exclusion: we refuse `modules_to_save` outright) plus the `"all-linear"`
  shorthand of `_maybe_include_all_linear_layers` (every projection, never `lm_head`);
- `lookup_pattern` is `peft.utils.other.get_pattern_key` as `LoraModel._create_and_replace`
  uses it for `rank_pattern` / `alpha_pattern`.

`key` is always the module name PEFT saw when it built the adapter: the tensor name without
`base_model.model.` and `.lora_A.weight`, e.g. `model.layers.3.self_attn.q_proj`.

PEFT matches with Python's `re`; every tenant-written pattern here is matched with RE2
(`adapters.linear_regex`), in linear time, with the same meaning (fullmatch for a regex
string, suffix match for a list of names).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from adapters.base_model import ALL_PROJECTIONS
from adapters.linear_regex import fullmatch, match

ALL_LINEAR = "all-linear"

T = TypeVar("T")


def target_selected(
    key: str,
    *,
    target_modules: str | Sequence[str],
    exclude_modules: str | Sequence[str] | None = None,
    layers_to_transform: int | Sequence[int] | None = None,
    layers_pattern: str | Sequence[str] | None = None,
) -> bool:
    """Whether PEFT would put a LoRA layer on module `key` (check_target_module_exists)."""
    if exclude_modules:
        if isinstance(exclude_modules, str):
            if fullmatch(exclude_modules, key):
                return False
        elif key in exclude_modules or any(key.endswith(f".{e}") for e in exclude_modules):
            return False

    if isinstance(target_modules, str):
        if target_modules.lower() == ALL_LINEAR:
            # PEFT expands it to the full names of every nn.Linear except the output embedding.
            return key.rsplit(".", 1)[-1] in ALL_PROJECTIONS
        # A string is a regex that must match the whole name; layers_to_transform is unused.
        return fullmatch(target_modules, key)
    if key in target_modules:
        # An exact full name wins before, and without, the layers_to_transform filter (PEFT's
        # elif chain does the same).
        return True
    if not any(key.endswith(f".{target}") for target in target_modules):
        return False
    if layers_to_transform is None or (
        not isinstance(layers_to_transform, int) and len(layers_to_transform) == 0
    ):
        return True
    layer = layer_index(key, layers_pattern)
    if layer is None:
        return False
    if isinstance(layers_to_transform, int):
        return layer == layers_to_transform
    return layer in layers_to_transform


def layer_index(key: str, layers_pattern: str | Sequence[str] | None) -> int | None:
    """The first numbered segment after the layers list (`model.layers.3.mlp.up_proj` → 3)."""
    if not layers_pattern:
        # Lazy `.*?` takes the first index, as PEFT does; it needs one dotted segment before
        # the list's name, so `layers.3.mlp.up_proj` (no `model.`) yields no index at all.
        match_ = match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        patterns = [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern
        match_ = None
        for pattern in patterns:
            match_ = match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if match_ is not None:
                break
    return None if match_ is None else int(match_.group("idx"))


def lookup_pattern(patterns: Mapping[str, T], key: str, default: T) -> T:
    """The override for `key` from a rank/alpha pattern dict, else `default`.

    PEFT takes the FIRST pattern in the dict's (i.e. the JSON file's) order that matches
    `re.match(rf"(.*\\.)?({pattern})$", key)`: the pattern, a regex, must match a whole
    dotted suffix of the name, so `v_proj` and `layers.0.self_attn.v_proj` both hit
    `model.layers.0.self_attn.v_proj`, but `proj` does not (no dot before it).
    PEFT writes the dict with sorted keys, so with overlapping patterns the file's (sorted)
    order can differ from the order used in training; like `PeftModel.from_pretrained`, we
    follow the file.
    """
    for pattern in patterns:
        if match(rf"(.*\.)?({pattern})$", key):
            return patterns[pattern]
    # get_pattern_key then returns `key` itself, and `.get(key, default)` looks it up
    # verbatim; kept for exactness (a key that is not a regex for itself could hit here).
    return patterns.get(key, default)
