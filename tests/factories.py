"""Test factories: tiny random Llama-family checkpoints written as real HF safetensors."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_VOCAB = 256


def make_checkpoint(
    path: Path,
    *,
    arch: str = "llama",
    tie_word_embeddings: bool = True,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = TINY_VOCAB,
    max_position_embeddings: int = 1024,
    rope_scaling: dict | None = None,
    eos_token_id: int = 2,
    seed: int = 0,
) -> Path:
    """Write a tiny random checkpoint; weights are scaled up so greedy choices are clear-cut."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[arch]
    extra = {"rope_scaling": rope_scaling} if rope_scaling else {}
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=eos_token_id,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf_model(path: Path):
    """The same checkpoint through transformers, fp32, eager attention: the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def random_prompts(num: int, *, min_len: int, max_len: int, vocab: int = TINY_VOCAB, seed: int = 0):
    """Token-id prompts of varied lengths, avoiding the special ids 0-2."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def add_byte_level_tokenizer(path: Path, *, vocab_size: int = 400) -> Path:
    """A small byte-level BPE with a plain chat template beside a checkpoint
    (``worker.model.tiny_families.write_byte_level_tokenizer``)."""
    from worker.model.tiny_families import write_byte_level_tokenizer

    return write_byte_level_tokenizer(path, vocab_size=vocab_size)


def make_peft_adapter(
    base_path: Path,
    out: Path,
    *,
    rank: int,
    targets: list[str],
    alpha: float | None = None,
    seed: int = 0,
    **lora_kwargs,
) -> Path:
    """A real PEFT LoRA adapter for the checkpoint at ``base_path``, saved as safetensors.

    A fresh LoRA has B = 0 (no effect); both A and B are randomized so the adapter matters.
    With ``use_dora=True``, PEFT starts each magnitude at the base weight's row norms (a factor
    of 1 once B is 0); they are scaled by a random 0.7-1.3 per output feature here. Saved module
    copies (``modules_to_save``) and trainable token rows are moved off the base's values.
    """
    from peft import LoraConfig, get_peft_model

    base = load_hf_model(base_path)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets, **lora_kwargs)
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(0.7 + 0.6 * torch.rand(param.shape, generator=g))
            elif "modules_to_save" in name or "trainable_tokens_delta" in name:
                # Trained copies and token rows: the base's values moved by their own scale.
                param.add_(torch.randn(param.shape, generator=g) * param.std())
            elif "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.3 / param.shape[-1] ** 0.5)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_perturbed_checkpoint(source: Path, out: Path, *, noise: float, seed: int = 0) -> Path:
    """A copy of ``source`` with Gaussian noise (``noise`` x each tensor's std) on every
    weight: a draft model that agrees with its target often, but not always."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "config.json", out / "config.json")
    g = torch.Generator().manual_seed(seed)
    weights = load_file(source / "model.safetensors")
    noisy = {
        name: w + noise * w.std() * torch.randn(w.shape, generator=g) for name, w in weights.items()
    }
    save_file(noisy, out / "model.safetensors")
    return out


def drain(engine) -> dict:
    """Step an `LLMEngine` until nothing is left; its final outputs by request id."""
    done = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def assert_no_block_leaks(engine) -> None:
    """Every KV block back in its pool: the engine's, the swap pool's and a draft model's."""
    pool = engine.block_manager
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_count == 0 for block in pool.blocks)
    host = engine.scheduler.host_block_manager
    if host is not None:
        assert host.num_free_blocks == host.num_blocks
    speculator = getattr(engine, "speculator", None)
    draft = getattr(getattr(speculator, "proposer", None), "block_manager", None)
    if draft is not None:
        assert draft.num_free_blocks == draft.num_blocks
    assert not engine.scheduler.has_work and not engine.has_pending_forks


def pretend_step(sched, *, finish: bool = False) -> list[tuple[str, int, int]]:
    """Schedule one step of a `Scheduler` and pretend the model ran it (``mark_computed``,
    so full blocks get cached): a sampling sequence gets token 7, and with ``finish`` one
    at its max_tokens ends. Returns the plan: (request id, start, tokens) per sequence."""
    from worker.core.sequence import SequenceStatus

    out = sched.schedule()
    plan = [(s.seq.request_id, s.start, s.num_tokens) for s in out.scheduled]
    sched.mark_computed(out)
    for s in out.scheduled:
        if s.samples:
            s.seq.append_token(7)
            if finish and len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                sched.remove(s.seq)
                s.seq.status = SequenceStatus.FINISHED
    return plan
