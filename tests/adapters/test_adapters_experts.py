"""LoRA on MoE experts (PEFT's target_parameters): read as PEFT saved it, each expert's delta as
PEFT computes it, the canonical form loadable by PEFT, and what is refused by name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from moe_factories import EXPERT_PARAMETERS, make_expert_adapter, make_moe_checkpoint
from safetensors.torch import load_file, save_file

from adapters import BaseModelSpec, LoraAdapter, load_adapter_dir
from adapters.canonical import canonical_files
from adapters.errors import IncompatibleAdapterError, UnsupportedAdapterFeatureError
from adapters.peft_names import WEIGHTS_FILE
from factories import load_hf_model

LIMITS = {"max_lora_rank": 16, "max_bytes": 1 << 24}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("qwen3_moe")
    base = make_moe_checkpoint(root / "base", "qwen3_moe")
    adapter = make_expert_adapter(
        base, root / "lora", rank=3, targets=["q_proj"], parameters=EXPERT_PARAMETERS
    )
    return base, adapter


def spec(base: Path) -> BaseModelSpec:
    return BaseModelSpec.from_config_dict(json.loads((base / "config.json").read_text()))


def read(base: Path, adapter: Path) -> LoraAdapter:
    return load_adapter_dir(adapter, base=spec(base), **LIMITS)


def test_expert_tensors_read_as_peft_computes_their_deltas(qwen):
    base, path = qwen
    adapter = read(base, path)
    # Layer 1 is Qwen3-MoE's dense layer (mlp_only_layers): no experts there.
    assert list(adapter.weights) == [
        (0, "q_proj"), (0, "experts.gate_up_proj"), (0, "experts.down_proj"),
        (1, "q_proj"),
        (2, "q_proj"), (2, "experts.gate_up_proj"), (2, "experts.down_proj"),
    ]  # fmt: skip
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_hf_model(base), path)
    wrapper = model.base_model.model.model.layers[0].mlp.experts  # down_proj's, outermost
    for module, peft_layer in (
        ("experts.down_proj", wrapper),
        ("experts.gate_up_proj", wrapper.base_layer),
    ):
        w = adapter.weights[(0, module)]
        assert w.rank == 3 and w.scaling == 2.0
        e = w.experts
        a = torch.from_numpy(w.a).reshape(e, w.rank, -1)
        b = torch.from_numpy(w.b).reshape(-1, w.rank, e)
        ours = w.scaling * torch.einsum("ore,eri->eoi", b, a)
        theirs = peft_layer.get_delta_weight("default")
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-7)


def test_the_canonical_form_loads_in_peft_and_rereads_to_the_same_id(qwen, tmp_path):
    base, path = qwen
    adapter = read(base, path)
    for name, data in canonical_files(adapter).items():
        (tmp_path / name).write_bytes(data)
    assert read(base, tmp_path).id == adapter.id
    from peft import PeftModel

    ids = torch.tensor([[5, 17, 99, 3, 42, 8, 200]])
    logits = []
    for source in (path, tmp_path):
        model = PeftModel.from_pretrained(load_hf_model(base), source)
        with torch.no_grad():
            logits.append(model(ids).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def _edit(path: Path, out: Path, *, tensors=None, **config) -> Path:
    out.mkdir()
    weights = load_file(path / WEIGHTS_FILE)
    save_file(tensors(weights) if tensors else weights, out / WEIGHTS_FILE)
    raw = json.loads((path / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**raw, **config}))
    return out


def test_a_target_parameter_other_than_the_experts_is_refused_by_name(qwen, tmp_path):
    base, path = qwen
    edited = _edit(path, tmp_path / "a", target_parameters=["mlp.gate.weight"])
    with pytest.raises(UnsupportedAdapterFeatureError, match=re.escape("'mlp.gate.weight'")):
        read(base, edited)


def test_expert_lora_on_a_dense_layer_is_refused(qwen, tmp_path):
    """Layer 1 of the fixture is dense: expert tensors moved there fit no experts."""
    base, path = qwen

    def to_layer_1(weights):
        moved = dict(weights)
        for k, v in weights.items():
            if ".layers.0.mlp.experts" in k:
                moved[k.replace(".layers.0.", ".layers.1.")] = v.clone()
        return moved

    edited = _edit(path, tmp_path / "a", tensors=to_layer_1, target_modules=["q_proj"])
    with pytest.raises(IncompatibleAdapterError, match="experts of layer 1"):
        read(base, edited)


def test_expert_shapes_of_another_base_are_refused(qwen, tmp_path):
    _, path = qwen
    other = make_moe_checkpoint(tmp_path / "other", "qwen3_moe", moe_intermediate_size=16)
    with pytest.raises(IncompatibleAdapterError, match="fit neither expert tensor"):
        read(other, path)


def test_an_mlp_adapter_on_mixtral_is_refused_naming_the_module(tmp_path):
    """Mixtral has no dense MLP: gate_proj is not one of its projections."""
    from factories import make_peft_adapter

    base = make_moe_checkpoint(tmp_path / "base", "mixtral")
    source = make_peft_adapter(base, tmp_path / "attn", rank=2, targets=["q_proj"])

    def to_gate_proj(weights):
        return {k.replace("self_attn.q_proj", "mlp.gate_proj"): v for k, v in weights.items()}

    edited = _edit(source, tmp_path / "a", tensors=to_gate_proj, target_modules=["gate_proj"])
    with pytest.raises(IncompatibleAdapterError, match="module 'gate_proj'"):
        read(base, edited)
