"""adapters/: PEFT LoRA adapters read, normalized and identified, checked against PEFT itself."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pytest

from adapter_factories import (
    LIMITS,
    copy_adapter,
    edit_config,
    peft_magnitudes,
    peft_reference,
    peft_saved,
    peft_tokens,
    read_tensors,
    reload_peft,
    save_adapter,
    tiny_config,
    tiny_spec,
    to_bf16_values,
    write_raw_safetensors,
    write_tensors,
)
from adapters import (
    AdapterTooLargeError,
    BaseModelSpec,
    IncompatibleAdapterError,
    InvalidAdapterError,
    LoraAdapter,
    UnsupportedAdapterFeatureError,
    load_adapter_dir,
    parse_adapter,
)
from adapters.peft_patterns import layer_index, lookup_pattern, target_selected

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
Q_A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def load(path: Path, *, base: BaseModelSpec | None = None, **limits: int) -> LoraAdapter:
    return load_adapter_dir(path, base=base or tiny_spec(), **{**LIMITS, **limits})


def assert_matches_peft(adapter: LoraAdapter, model: Any) -> None:
    reference = peft_reference(model)
    assert set(adapter.weights) == set(reference)
    for key, (a, b, scaling) in reference.items():
        w = adapter.weights[key]
        assert w.a.dtype == np.float32 and w.b.dtype == np.float32
        np.testing.assert_array_equal(w.a, a, err_msg=str(key))
        np.testing.assert_array_equal(w.b, b, err_msg=str(key))
        assert w.scaling == scaling, key


@pytest.fixture(scope="module")
def seven(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved adapter on all seven projections, rank 4: the base of every mutation below."""
    path = tmp_path_factory.mktemp("seven") / "adapter"
    save_adapter(path, r=4, lora_alpha=8, target_modules=ALL_SEVEN)
    return path


@pytest.fixture
def adapter_dir(seven: Path, tmp_path: Path) -> Path:
    return copy_adapter(seven, tmp_path / "adapter")


# --- the base model ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_base_model_spec_reads_hf_config_dicts(arch: str) -> None:
    spec = BaseModelSpec.from_config_dict(tiny_config(arch).to_dict())
    assert spec == BaseModelSpec(
        model_type=arch,
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=128,
    )


def test_base_model_spec_defaults_and_refusals() -> None:
    mistral = {
        "model_type": "mistral",
        "hidden_size": 96,
        "num_attention_heads": 6,
        "num_hidden_layers": 3,
        "intermediate_size": 192,
        "vocab_size": 10,
        "head_dim": None,
    }
    spec = BaseModelSpec.from_config_dict(mistral)
    assert (spec.num_kv_heads, spec.head_dim) == (6, 16)  # defaults: heads, hidden / heads
    assert spec.projection_shape("o_proj") == (96, 96)
    assert spec.projection_shape("down_proj") == (192, 96)
    with pytest.raises(ValueError, match="'gpt2' is not one of"):
        BaseModelSpec.from_config_dict({**mistral, "model_type": "gpt2"})


# --- normalization equals PEFT ----------------------------------------------------------

CASES = {
    "list targets": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "regex targets": {"r": 3, "lora_alpha": 5, "target_modules": r".*\.(k_proj|o_proj)"},
    "all seven, rank 1": {"r": 1, "lora_alpha": 2, "target_modules": ALL_SEVEN},
    "all-linear": {"r": 2, "lora_alpha": 4, "target_modules": "all-linear"},
    "layers_to_transform list + pattern": {
        "r": 4,
        "target_modules": ["q_proj", "down_proj"],
        "layers_to_transform": [1],
        "layers_pattern": "layers",
    },
    "layers_to_transform int": {"r": 4, "target_modules": ["up_proj"], "layers_to_transform": 0},
    "exclude_modules": {
        "r": 4,
        "target_modules": ["q_proj", "v_proj"],
        "exclude_modules": ["model.layers.0.self_attn.v_proj"],
    },
    "rank and alpha patterns (first match wins)": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ALL_SEVEN,
        "rank_pattern": {"layers.1.self_attn.q_proj": 6, "v_proj": 2},
        # Both match layer 1's down_proj: the first key wins (3).
        "alpha_pattern": {"down_proj": 3, r"model\.layers\.1\..*": 5},
    },
    "use_rslora": {"r": 8, "lora_alpha": 16, "use_rslora": True, "target_modules": ALL_SEVEN},
}


@pytest.mark.parametrize("lora", CASES.values(), ids=CASES.keys())
def test_normalized_weights_equal_peft(lora: dict[str, Any], tmp_path: Path) -> None:
    model = save_adapter(tmp_path / "a", **lora)
    adapter = load(tmp_path / "a")
    assert_matches_peft(adapter, model)  # as trained
    assert_matches_peft(adapter, reload_peft(tmp_path / "a"))  # as PEFT serves the files
    assert adapter.max_rank == max(w.rank for w in adapter.weights.values())
    assert adapter.num_bytes == sum(w.a.nbytes + w.b.nbytes for w in adapter.weights.values())


def test_overlapping_patterns_follow_the_saved_file_like_peft_does(tmp_path: Path) -> None:
    """PEFT takes the first matching pattern key but saves the keys sorted, so a config whose
    keys were not in sorted order trains with one alpha and reloads with another. We serve
    what PEFT serves from the files (the reloaded model), and this pins that choice."""
    alpha_pattern = {"layers.0.mlp.down_proj": 7, "down_proj": 3}
    trained = save_adapter(
        tmp_path / "a", r=4, target_modules=["down_proj"], alpha_pattern=alpha_pattern
    )
    adapter = load(tmp_path / "a")
    assert trained.base_model.model.model.layers[0].mlp.down_proj.scaling["default"] == 7 / 4
    assert_matches_peft(adapter, reload_peft(tmp_path / "a"))
    assert adapter.weights[(0, "down_proj")].scaling == 3 / 4


def test_qwen2_base_all_seven_projections(tmp_path: Path) -> None:
    model = save_adapter(tmp_path / "a", arch="qwen2", r=4, target_modules=ALL_SEVEN)
    adapter = load(tmp_path / "a", base=tiny_spec("qwen2"))
    assert_matches_peft(adapter, model)
    assert_matches_peft(adapter, reload_peft(tmp_path / "a", arch="qwen2"))
    assert adapter.target_modules == frozenset(ALL_SEVEN)
    assert adapter.weights[(0, "k_proj")].b.shape == (32, 4)  # GQA: 2 kv heads x 16


def test_weights_come_out_in_canonical_order(seven: Path) -> None:
    keys = list(load(seven).weights)
    assert keys == [(layer, module) for layer in (0, 1) for module in ALL_SEVEN]


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_half_precision_files_are_widened_exactly(dtype: str, adapter_dir: Path) -> None:
    tensors = read_tensors(adapter_dir)
    write_tensors(adapter_dir, tensors, dtype=dtype)
    adapter = load(adapter_dir)
    # The reference widening: numpy for fp16, torch for bf16 (numpy has no bf16).
    widen = (
        (lambda x: x.astype(np.float16).astype(np.float32)) if dtype == "F16" else to_bf16_values
    )
    np.testing.assert_array_equal(adapter.weights[(0, "q_proj")].a, widen(tensors[Q_A0]))
    np.testing.assert_array_equal(adapter.weights[(0, "q_proj")].b, widen(tensors[Q_B0]))


def test_parse_adapter_reads_uploaded_bytes(seven: Path) -> None:
    config = (seven / "adapter_config.json").read_bytes()
    weights = (seven / "adapter_model.safetensors").read_bytes()
    adapter = parse_adapter(config, weights, base=tiny_spec(), **LIMITS)
    assert adapter.id == load(seven).id


# --- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["adapter_model.bin", "adapter.pt", "weights.pth", "state.pkl", "last.ckpt"]
)
def test_pickled_weights_are_refused_unopened(name: str, adapter_dir: Path, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    # Unpickling this file would create `marker`.
    (adapter_dir / name).write_bytes(pickle.dumps(_Touch(marker)))
    with pytest.raises(UnsupportedAdapterFeatureError, match=re.escape(f"{name}: pickled weights")):
        load(adapter_dir)
    assert not marker.exists()


class _Touch:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[Path]]:
        return Path.touch, (self.path,)


PEFT_REFUSALS = {
    "modules_to_save norm": (
        {"modules_to_save": ["norm"]},
        "modules_to_save=['norm']: a trained copy of 'norm' is not served",
    ),
    "lm_head target": ({"target_modules": ["q_proj", "lm_head"]}, "selects 'lm_head'"),
    "embed target": ({"target_modules": ["embed_tokens"]}, "selects 'model.embed_tokens'"),
    "bias lora_only": ({"bias": "lora_only"}, "bias='lora_only'"),
    "lora_bias": ({"lora_bias": True}, "lora_bias=True"),
}


@pytest.mark.parametrize("lora, message", PEFT_REFUSALS.values(), ids=PEFT_REFUSALS.keys())
def test_unsupported_peft_features_are_refused(
    lora: dict[str, Any], message: str, tmp_path: Path
) -> None:
    save_adapter(tmp_path / "a", **{"r": 2, "target_modules": ["q_proj"], **lora})
    with pytest.raises(UnsupportedAdapterFeatureError, match=re.escape(message)):
        load(tmp_path / "a")


CONFIG_REFUSALS = [
    pytest.param({"peft_type": "IA3"}, "peft_type is 'IA3'", id="peft_type"),
    pytest.param({"fan_in_fan_out": True}, "fan_in_fan_out=True", id="fan_in_fan_out"),
    pytest.param({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'", id="pissa init"),
    pytest.param(
        {"target_modules": [*ALL_SEVEN, "lm_head"]}, "selects 'lm_head'", id="lm_head listed"
    ),
]


@pytest.mark.parametrize("change, message", CONFIG_REFUSALS)
def test_unsupported_config_fields_are_refused(
    change: dict[str, Any], message: str, adapter_dir: Path
) -> None:
    edit_config(adapter_dir, **change)
    with pytest.raises(UnsupportedAdapterFeatureError, match=re.escape(message)):
        load(adapter_dir)


INVALID_CONFIGS = [
    pytest.param(
        {"r": 8},
        "gives 'model.layers.0.mlp.down_proj' rank 8 (r / rank_pattern) but tensor",
        id="r differs from the tensors",
    ),
    pytest.param(
        {"target_modules": ALL_SEVEN[:-1]},
        "is for 'model.layers.0.mlp.down_proj', which adapter_config.json does not target",
        id="tensor not targeted",
    ),
    pytest.param(
        {"layers_to_transform": [0], "layers_pattern": "layers"},
        "is for 'model.layers.1.mlp.down_proj', which adapter_config.json does not target",
        id="layers_to_transform drops a layer",
    ),
    pytest.param(
        {"target_modules": ".*", "layers_to_transform": [0]},
        "layers_to_transform cannot be used when target_modules is a regex string",
        id="regex with layers_to_transform",
    ),
    pytest.param(
        {"rank_pattern": {"q_proj(": 2}}, "key 'q_proj(' is not a valid regex", id="regex"
    ),
    pytest.param({"lora_alpha": float("nan")}, "NaN is not valid JSON", id="NaN alpha"),
    pytest.param({"r": True}, "r must be a positive integer, got True", id="bool r"),
    pytest.param({"target_modules": None}, "target_modules is missing", id="no targets"),
    pytest.param({"r": 10**9}, "r=1000000000 is over 65536", id="huge r"),
    pytest.param({"rank_pattern": {"q_proj": 2**40}}, "is over 65536", id="huge rank_pattern"),
    pytest.param({"lora_alpha": float("inf")}, "Infinity is not valid JSON", id="inf alpha"),
    pytest.param({"lora_alpha": 1e300}, "lora_alpha=1e+300 is outside +-10000", id="huge alpha"),
    pytest.param(
        {"alpha_pattern": {"v_proj": -1e5}}, "is outside +-10000", id="huge alpha_pattern"
    ),
    pytest.param(
        {"target_modules": r"(q)_proj\1"}, "is not a valid regex (invalid escape", id="RE2 refuses"
    ),
    pytest.param(
        {"target_modules": "(?=q).*"}, "is not a valid regex (invalid perl operator", id="lookahead"
    ),
    pytest.param({"target_modules": ["q_proj"] * 5000}, "over 4096", id="long target list"),
    pytest.param(
        {"layers_to_transform": [10**12], "layers_pattern": "layers"},
        "integers from 0 to 1048576",
        id="huge layer index",
    ),
]


@pytest.mark.parametrize("change, message", INVALID_CONFIGS)
def test_invalid_configs_are_refused(
    change: dict[str, Any], message: str, adapter_dir: Path
) -> None:
    edit_config(adapter_dir, **change)
    with pytest.raises(InvalidAdapterError, match=re.escape(message)):
        load(adapter_dir)


def test_missing_config_or_weights(adapter_dir: Path) -> None:
    (adapter_dir / "adapter_model.safetensors").unlink()
    with pytest.raises(
        InvalidAdapterError, match=re.escape("adapter_model.safetensors is missing from")
    ):
        load(adapter_dir)
    (adapter_dir / "adapter_config.json").unlink()
    with pytest.raises(InvalidAdapterError, match=re.escape("adapter_config.json is missing from")):
        load(adapter_dir)


def _nan(t: dict[str, np.ndarray]) -> None:
    t[Q_B0] = t[Q_B0].copy()
    t[Q_B0][3, 1] = np.nan


def _inf(t: dict[str, np.ndarray]) -> None:
    t[Q_A0] = t[Q_A0].copy()
    t[Q_A0][0, 0] = -np.inf


def _rename_q_to_dense(t: dict[str, np.ndarray]) -> None:
    t[Q_A0.replace("q_proj", "dense")] = t.pop(Q_A0)


def _rename_q_to_qkv(t: dict[str, np.ndarray]) -> None:
    """Phi-3's fused module, on a base that has none (both tensors renamed)."""
    for name in (Q_A0, Q_A0.replace("lora_A", "lora_B")):
        t[name.replace("q_proj", "qkv_proj")] = t.pop(name)


def _replace(name: str, value: Any) -> Any:
    return lambda t: t.update({name: value(t)})


TENSOR_REFUSALS = [
    pytest.param(
        _nan,
        InvalidAdapterError,
        f"'{Q_B0}' holds 1 non-finite values (first: nan at index [3, 1])",
        id="NaN",
    ),
    pytest.param(
        _inf, InvalidAdapterError, f"'{Q_A0}' holds 1 non-finite values (first: -inf", id="Inf"
    ),
    pytest.param(
        _rename_q_to_dense,
        IncompatibleAdapterError,
        "is for module 'model.layers.0.self_attn.dense', which no served base model has",
        id="unknown module",
    ),
    pytest.param(
        _rename_q_to_qkv,
        IncompatibleAdapterError,
        "is for module 'qkv_proj', which this llama base model does not have",
        id="module of another family",
    ),
    pytest.param(
        lambda t: t.pop(Q_B0),
        InvalidAdapterError,
        f"tensor '{Q_A0}' has no matching lora_B ({Q_B0} is missing)",
        id="missing B",
    ),
    pytest.param(
        lambda t: [t.pop(Q_A0), t.pop(Q_B0)],
        InvalidAdapterError,
        "targets 'model.layers.0.self_attn.q_proj' but adapter_model.safetensors has no",
        id="targeted module without tensors",
    ),
    pytest.param(
        _replace(Q_B0, lambda t: t[Q_B0][:, :3]),
        InvalidAdapterError,
        "lora_A [4, 64] has rank 4 but lora_B [64, 3] has rank 3",
        id="A and B ranks differ",
    ),
    pytest.param(
        _replace(Q_A0, lambda t: t[Q_A0][:, :60]),
        IncompatibleAdapterError,
        f"'{Q_A0}' has shape [4, 60], expected [4, 64] for q_proj",
        id="wrong in_features",
    ),
    pytest.param(
        _replace(Q_A0, lambda t: t[Q_A0][None]),
        InvalidAdapterError,
        "has shape [1, 4, 64]; LoRA weights are 2-D",
        id="3-D tensor",
    ),
    pytest.param(
        _replace(Q_B0.replace("weight", "bias"), lambda t: np.zeros(64, np.float32)),
        UnsupportedAdapterFeatureError,
        "lora_B.bias': a LoRA bias (lora_bias) is not served",
        id="lora_B bias tensor",
    ),
    pytest.param(
        _replace("base_model.model.lm_head.lora_A.weight", lambda t: t[Q_A0]),
        UnsupportedAdapterFeatureError,
        "LoRA on the embedding or lm_head is not served",
        id="lm_head tensor",
    ),
    pytest.param(
        _replace(Q_A0.replace("lora_A.weight", "lora_magnitude_vector"), lambda t: t[Q_A0][0]),
        InvalidAdapterError,
        "is a DoRA magnitude but adapter_config.json does not set use_dora",
        id="DoRA magnitude without use_dora",
    ),
    pytest.param(
        _replace("base_model.model.foo", lambda t: t[Q_A0]),
        InvalidAdapterError,
        "'base_model.model.foo' is not a LoRA weight",
        id="foreign tensor",
    ),
    pytest.param(
        _replace("layers.0.x", lambda t: t[Q_A0]),
        InvalidAdapterError,
        "'layers.0.x' does not start with 'base_model.model.'",
        id="no PEFT prefix",
    ),
    pytest.param(lambda t: t.clear(), InvalidAdapterError, "holds no LoRA tensors", id="empty"),
]


@pytest.mark.parametrize("mutate, error, message", TENSOR_REFUSALS)
def test_tensor_refusals(
    mutate: Any, error: type[Exception], message: str, adapter_dir: Path
) -> None:
    tensors = read_tensors(adapter_dir)
    mutate(tensors)
    write_tensors(adapter_dir, tensors)
    with pytest.raises(error, match=re.escape(message)):
        load(adapter_dir)


BASE_MISMATCHES = [
    pytest.param(
        {"num_hidden_layers": 1},
        "is for layer 1, but the base model has 1 layers (0..0)",
        id="too few layers",
    ),
    pytest.param(
        {"num_key_value_heads": 4},
        "k_proj.lora_B.weight' has shape [32, 4], expected [64, 4] for k_proj",
        id="kv heads",
    ),
    pytest.param(
        {"intermediate_size": 256},
        "down_proj.lora_A.weight' has shape [4, 128], expected [4, 256] for down_proj",
        id="intermediate size",
    ),
]


@pytest.mark.parametrize("overrides, message", BASE_MISMATCHES)
def test_adapter_for_another_base_is_incompatible(
    overrides: dict[str, int], message: str, seven: Path
) -> None:
    with pytest.raises(IncompatibleAdapterError, match=re.escape(message)):
        load(seven, base=tiny_spec(**overrides))


def test_deployment_limits(seven: Path, adapter_dir: Path) -> None:
    with pytest.raises(AdapterTooLargeError, match="has rank 4, over max_lora_rank=2"):
        load(seven, max_lora_rank=2)
    size = (seven / "adapter_model.safetensors").stat().st_size
    with pytest.raises(AdapterTooLargeError, match=f"is {size} bytes, over the limit of 1000"):
        load(seven, max_bytes=1000)
    # An fp16 file under the bound whose float32 form is over it is refused too.
    write_tensors(adapter_dir, read_tensors(adapter_dir), dtype="F16")
    fp16_size = (adapter_dir / "adapter_model.safetensors").stat().st_size
    with pytest.raises(AdapterTooLargeError, match="as float32, over the limit"):
        load(adapter_dir, max_bytes=fp16_size + 100)


def test_malformed_safetensors(adapter_dir: Path) -> None:
    file = adapter_dir / "adapter_model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-4])
    with pytest.raises(InvalidAdapterError, match=r"tensors cover \d+ bytes of a \d+-byte buffer"):
        load(adapter_dir)
    file.write_bytes((10**6).to_bytes(8, "little") + data[8:])
    with pytest.raises(InvalidAdapterError, match="header length 1000000 exceeds the file"):
        load(adapter_dir)
    write_raw_safetensors(file, [(Q_A0, "F64", (4, 64), bytes(4 * 64 * 8))])
    with pytest.raises(UnsupportedAdapterFeatureError, match="dtype 'F64'; only F32, F16 and BF16"):
        load(adapter_dir)


# --- identity ---------------------------------------------------------------------------


def test_identity_is_content(tmp_path: Path) -> None:
    for name, seed in (("one", 0), ("two", 0), ("other_seed", 1)):
        save_adapter(tmp_path / name, seed=seed, r=4, target_modules=ALL_SEVEN)
    copy_adapter(tmp_path / "one", tmp_path / "renamed")
    ids = {p.name: load_id(p) for p in tmp_path.iterdir()}
    assert ids["one"] == ids["two"] == ids["renamed"]  # saved twice, or moved: same id
    assert ids["other_seed"] != ids["one"]
    assert len(ids["one"]) == 64 and set(ids["one"]) <= set("0123456789abcdef")


def load_id(path: Path) -> str:
    return load(path).id


def test_identity_ignores_tensor_order_and_exact_upcasts(adapter_dir: Path, tmp_path: Path) -> None:
    # Values that fp16 represents exactly, so fp16 and fp32 files hold the same adapter.
    tensors = {
        k: v.astype(np.float16).astype(np.float32) for k, v in read_tensors(adapter_dir).items()
    }
    write_tensors(adapter_dir, tensors)
    reference = load_id(adapter_dir)
    reordered = copy_adapter(adapter_dir, tmp_path / "reordered")
    write_tensors(reordered, dict(reversed(list(tensors.items()))))
    assert (reordered / "adapter_model.safetensors").read_bytes() != (
        adapter_dir / "adapter_model.safetensors"
    ).read_bytes()
    assert load_id(reordered) == reference
    write_tensors(reordered, tensors, dtype="F16")
    assert load_id(reordered) == reference


def test_identity_changes_with_any_value_or_scaling(adapter_dir: Path) -> None:
    reference = load_id(adapter_dir)
    tensors = read_tensors(adapter_dir)
    nudged = dict(tensors)
    nudged[Q_B0] = tensors[Q_B0].copy()
    nudged[Q_B0][5, 2] = np.nextafter(nudged[Q_B0][5, 2], np.float32(np.inf))  # one ulp
    write_tensors(adapter_dir, nudged)
    assert load_id(adapter_dir) != reference
    write_tensors(adapter_dir, tensors)
    assert load_id(adapter_dir) == reference
    edit_config(adapter_dir, lora_alpha=16)  # scaling 2 -> 4
    assert load_id(adapter_dir) != reference
    # Same scaling another way (rslora: 4 / sqrt(4) = 2 = 8 / 4): same computation, same id.
    edit_config(adapter_dir, lora_alpha=4, use_rslora=True)
    assert load_id(adapter_dir) == reference


def test_adapter_saved_from_a_bare_model_is_the_same_adapter(adapter_dir: Path) -> None:
    """PEFT on `LlamaModel` (not `LlamaForCausalLM`) drops the inner `model.` from names."""
    reference = load_id(adapter_dir)
    tensors = read_tensors(adapter_dir)
    bare = {
        k.replace("base_model.model.model.", "base_model.model."): v for k, v in tensors.items()
    }
    write_tensors(adapter_dir, bare)
    assert load_id(adapter_dir) == reference


# --- bounds against hostile files ------------------------------------------------------


class CountingReader:
    """A file whose reads are tallied in `sizes` (bytes each read returned)."""

    def __init__(self, file: BinaryIO, sizes: list[int]) -> None:
        self.file, self.sizes = file, sizes

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        self.sizes.append(len(data))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)

    def __enter__(self) -> CountingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()


def count_reads(monkeypatch: pytest.MonkeyPatch, path: Path) -> list[int]:
    """From now on, the bytes each read of `path` (opened through Path.open) returns."""
    sizes: list[int] = []
    real_open = Path.open

    def open_(self: Path, *args: Any, **kwargs: Any) -> Any:
        file = real_open(self, *args, **kwargs)
        return CountingReader(file, sizes) if self == path else file

    monkeypatch.setattr(Path, "open", open_)
    return sizes


def test_giant_header_length_is_refused_before_reading(
    adapter_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefix claiming 2^63 header bytes is refused on the 8 bytes, whatever the file."""
    file = adapter_dir / "adapter_model.safetensors"
    file.write_bytes((2**63).to_bytes(8, "little") + bytes(64))
    reads = count_reads(monkeypatch, file)
    with pytest.raises(InvalidAdapterError, match="is over the limit of 1048576 bytes"):
        load(adapter_dir)
    assert sum(reads) == 8  # the length prefix alone: nothing past it was read
    with pytest.raises(InvalidAdapterError, match="is over the limit of 1048576 bytes"):
        parse_adapter(
            (adapter_dir / "adapter_config.json").read_bytes(),
            file.read_bytes(),
            base=tiny_spec(),
            **{"max_lora_rank": 64, "max_bytes": 8 << 20},
        )


def test_header_with_more_tensors_than_the_base_allows(adapter_dir: Path) -> None:
    # The tiny base has 2 layers x 7 projections: 28 LoRA tensors, room for as many strays,
    # two saved module copies (embed_tokens, lm_head) and trainable token rows.
    entries = [(f"t{i}", "F32", (1,), bytes(4)) for i in range(60)]
    write_raw_safetensors(adapter_dir / "adapter_model.safetensors", entries)
    with pytest.raises(InvalidAdapterError, match=r"lists 60 tensors; .* at most 59"):
        load(adapter_dir)


def test_deeply_nested_json_is_a_clear_refusal(adapter_dir: Path) -> None:
    (adapter_dir / "adapter_config.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(InvalidAdapterError, match="nested too deeply"):
        load(adapter_dir)


PATHOLOGICAL = r"([a-z_.0-9]+)+X"  # Python's re: 2^len(name) steps before it fails


# A hang guard: a backtracking engine takes 2^len(name) steps on these and never finishes;
# a linear-time one is done at once.
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "field", ["target_modules", "exclude_modules", "rank_pattern", "layers_pattern"]
)
def test_pathological_regexes_match_in_linear_time(field: str) -> None:
    long_name = "model." + "a" * 50_000 + ".self_attn.q_proj"
    for key in ("model.layers.0.self_attn.q_proj", long_name):
        if field == "target_modules":
            assert not target_selected(key, target_modules=PATHOLOGICAL)
        elif field == "exclude_modules":
            assert target_selected(key, target_modules=["q_proj"], exclude_modules=PATHOLOGICAL)
        elif field == "rank_pattern":
            assert lookup_pattern({PATHOLOGICAL: 2}, key, 8) == 8
        else:
            assert layer_index(key, PATHOLOGICAL) is None


@pytest.mark.timeout(60)  # a hang guard, as above
def test_pathological_target_modules_adapter_is_refused_fast(adapter_dir: Path) -> None:
    edit_config(adapter_dir, target_modules=PATHOLOGICAL)
    with pytest.raises(InvalidAdapterError, match=r"which adapter_config\.json does not"):
        load(adapter_dir)


# --- DoRA -------------------------------------------------------------------------------


def test_dora_magnitudes_are_read_as_peft_holds_them(tmp_path: Path) -> None:
    path = tmp_path / "dora"
    model = save_adapter(path, r=2, target_modules=["q_proj", "down_proj"], use_dora=True)
    adapter = load(path)
    assert_matches_peft(adapter, model)
    magnitudes = peft_magnitudes(model)
    assert adapter.uses_dora and set(magnitudes) == set(adapter.weights)
    for key, magnitude in magnitudes.items():
        np.testing.assert_array_equal(adapter.weights[key].magnitude, magnitude, err_msg=str(key))
    # The same A and B without the magnitudes: a plain adapter, and another id.
    tensors = read_tensors(path)
    write_tensors(path, {k: v for k, v in tensors.items() if "magnitude" not in k})
    edit_config(path, use_dora=False)
    plain = load(path)
    assert not plain.uses_dora and plain.id != adapter.id
    assert plain.num_bytes < adapter.num_bytes


Q_M0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"


@pytest.mark.parametrize(
    "edit, error, message",
    [
        pytest.param(
            lambda t: {k: v for k, v in t.items() if k != Q_M0},
            InvalidAdapterError,
            "sets use_dora but 'model.layers.0.self_attn.q_proj' has no",
            id="magnitude missing",
        ),
        pytest.param(
            lambda t: {**t, Q_M0: t[Q_M0][:10]},
            IncompatibleAdapterError,
            "has shape [10], expected [64]",
            id="magnitude shape",
        ),
        pytest.param(
            lambda t: {**t, Q_M0: np.full_like(t[Q_M0], np.nan)},
            InvalidAdapterError,
            "non-finite values",
            id="magnitude NaN",
        ),
        pytest.param(
            lambda t: {Q_M0: t[Q_M0]},
            InvalidAdapterError,
            "DoRA magnitude without its LoRA weights",
            id="magnitude alone",
        ),
    ],
)
def test_dora_refusals(edit: Any, error: type[Exception], message: str, tmp_path: Path) -> None:
    path = tmp_path / "dora"
    save_adapter(path, r=2, target_modules=["q_proj"], use_dora=True)
    write_tensors(path, edit(read_tensors(path)))
    with pytest.raises(error, match=re.escape(message)):
        load(path)


# --- modules_to_save --------------------------------------------------------------------

HEAD = "base_model.model.lm_head.weight"
EMBED = "base_model.model.model.embed_tokens.weight"


def test_saved_copies_are_read_as_peft_holds_them(tmp_path: Path) -> None:
    path = tmp_path / "saved"
    model = save_adapter(
        path, r=2, target_modules=["q_proj"], modules_to_save=["lm_head", "embed_tokens"]
    )
    adapter = load(path)
    assert_matches_peft(adapter, model)
    copies = peft_saved(model)
    assert set(copies) == set(adapter.saved) == {"lm_head", "embed_tokens"}
    for module, copy in copies.items():
        np.testing.assert_array_equal(adapter.saved[module], copy, err_msg=module)
    tensors = read_tensors(path)
    write_tensors(path, {k: v for k, v in tensors.items() if k not in (HEAD, EMBED)})
    edit_config(path, modules_to_save=None)
    plain = load(path)
    assert plain.id != adapter.id
    vocab, hidden = copies["lm_head"].shape
    assert adapter.num_bytes - plain.num_bytes == 2 * 4 * vocab * hidden


def test_saved_copies_count_in_the_byte_limit(tmp_path: Path) -> None:
    path = tmp_path / "saved"
    save_adapter(path, r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    write_tensors(path, read_tensors(path), dtype="BF16")  # the file fits; float32 does not
    with pytest.raises(
        AdapterTooLargeError, match="of them module copies or token rows"
    ) as refused:
        load(path, max_bytes=128 * 64 * 4)
    assert refused.value.field == "modules_to_save"


@pytest.mark.parametrize(
    "edit, config, error, message",
    [
        pytest.param(
            lambda t: {k: v for k, v in t.items() if k != HEAD},
            {},
            InvalidAdapterError,
            "lists lm_head in modules_to_save but the weights have no base_model.model.lm_head",
            id="copy missing",
        ),
        pytest.param(
            lambda t: t,
            {"modules_to_save": ["embed_tokens"]},
            InvalidAdapterError,
            "is a trained copy of lm_head, but adapter_config.json's modules_to_save does not",
            id="copy not listed",
        ),
        pytest.param(
            lambda t: {**t, HEAD: t[HEAD][:100]},
            {},
            IncompatibleAdapterError,
            "has shape [100, 64], expected [128, 64]",
            id="copy shape",
        ),
        pytest.param(
            lambda t: {**t, HEAD: np.full_like(t[HEAD], np.inf)},
            {},
            InvalidAdapterError,
            "non-finite values",
            id="copy infinite",
        ),
        pytest.param(
            lambda t: t,
            {"modules_to_save": ["lm_head", "model.layers.0.mlp"]},
            UnsupportedAdapterFeatureError,
            "a trained copy of 'model.layers.0.mlp' is not served",
            id="other module listed",
        ),
    ],
)
def test_saved_copy_refusals(
    edit: Any, config: dict[str, Any], error: type[Exception], message: str, tmp_path: Path
) -> None:
    path = tmp_path / "saved"
    save_adapter(path, r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    write_tensors(path, edit(read_tensors(path)))
    if config:
        edit_config(path, **config)
    with pytest.raises(error, match=re.escape(message)):
        load(path)


def test_tied_copies_under_ensure_weight_tying(tmp_path: Path) -> None:
    """On a tied base, ensure_weight_tying makes one copy serve both modules, as PEFT ties them;
    two copies that differ are refused (PEFT would keep one of them, silently)."""
    tied = tiny_spec(tie_word_embeddings=True)
    path = tmp_path / "saved"
    save_adapter(path, r=2, target_modules=["q_proj"], modules_to_save=["embed_tokens"])
    edit_config(path, ensure_weight_tying=True)
    tensors = read_tensors(path)
    with pytest.raises(InvalidAdapterError, match="does not list it"):  # untied base
        write_tensors(path, {**tensors, HEAD: tensors[EMBED]})
        load(path)
    adapter = load(path, base=tied)
    assert adapter.saved["lm_head"] is adapter.saved["embed_tokens"]
    assert adapter.num_bytes == load(path, base=tied).num_bytes
    write_tensors(path, {k: v for k, v in tensors.items() if k != HEAD})
    alone = load(path, base=tied)
    assert alone.id == adapter.id and set(alone.saved) == {"embed_tokens", "lm_head"}
    write_tensors(path, {**tensors, HEAD: tensors[EMBED] + 1})
    with pytest.raises(InvalidAdapterError, match="the two saved copies differ"):
        load(path, base=tied)


# --- trainable_token_indices ------------------------------------------------------------

TOKENS = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"


def test_trainable_token_rows_are_read_as_peft_holds_them(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    model = save_adapter(path, r=2, target_modules=["q_proj"], trainable_token_indices=[7, 2, 90])
    adapter = load(path)
    assert_matches_peft(adapter, model)
    rows = peft_tokens(model)
    assert adapter.tokens is not None and adapter.tokens.ids.tolist() == [2, 7, 90]
    for k, token in enumerate(adapter.tokens.ids.tolist()):
        np.testing.assert_array_equal(adapter.tokens.rows[k], rows[token], err_msg=str(token))
    # The dict form names the same rows: the same adapter.
    edit_config(path, trainable_token_indices={"embed_tokens": [7, 2, 90]})
    assert load(path).id == adapter.id
    tensors = read_tensors(path)
    write_tensors(path, {k: v for k, v in tensors.items() if k != TOKENS})
    edit_config(path, trainable_token_indices=None)
    plain = load(path)
    assert plain.id != adapter.id and plain.tokens is None
    assert adapter.num_bytes - plain.num_bytes == 3 * (8 + 4 * 64)


@pytest.mark.parametrize(
    "edit, config, error, message",
    [
        pytest.param(
            lambda t: t,
            {"trainable_token_indices": [7, 2, 7]},
            InvalidAdapterError,
            "lists a token id twice",
            id="duplicate id",
        ),
        pytest.param(
            lambda t: t,
            {"trainable_token_indices": [7, 2, 128]},
            IncompatibleAdapterError,
            "token id 128, outside this base model's vocabulary of 128",
            id="id outside the vocabulary",
        ),
        pytest.param(
            lambda t: t,
            {"trainable_token_indices": {"lm_head": [7, 2, 5]}},
            UnsupportedAdapterFeatureError,
            "targets 'lm_head'; only the input embedding (embed_tokens) is served",
            id="another layer",
        ),
        pytest.param(
            lambda t: {k: v for k, v in t.items() if k != TOKENS},
            {},
            InvalidAdapterError,
            "sets trainable_token_indices but the weights have no",
            id="rows missing",
        ),
        pytest.param(
            lambda t: t,
            {"trainable_token_indices": None},
            InvalidAdapterError,
            "holds trainable token rows but adapter_config.json sets no",
            id="rows not configured",
        ),
        pytest.param(
            lambda t: {**t, TOKENS: t[TOKENS][:2]},
            {},
            IncompatibleAdapterError,
            "has shape [2, 64], expected [3, 64]",
            id="rows shape",
        ),
        pytest.param(
            lambda t: t,
            {"modules_to_save": ["embed_tokens"]},
            InvalidAdapterError,
            "trainable_token_indices and modules_to_save both replace embed_tokens",
            id="with a copy of embed_tokens",
        ),
    ],
)
def test_trainable_token_refusals(
    edit: Any, config: dict[str, Any], error: type[Exception], message: str, tmp_path: Path
) -> None:
    path = tmp_path / "tokens"
    save_adapter(path, r=2, target_modules=["q_proj"], trainable_token_indices=[7, 2, 5])
    write_tensors(path, edit(read_tensors(path)))
    if config:
        edit_config(path, **config)
    with pytest.raises(error, match=re.escape(message)):
        load(path)
