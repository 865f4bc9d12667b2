"""The default model published quantized by a format's own tool, served as published.

- ``make`` (run in a venv with ``compressed-tensors==0.20.1`` beside ``torch==2.13.0``, never the
  project's): SmolLM2-135M-Instruct compressed by compressed-tensors itself into a
  ``pack-quantized`` checkpoint, round to nearest (the library's ``calculate_qparams`` over each
  group's range): ``w4a16`` symmetric int4 in groups of 64 (its 576 hidden features take no group
  of 128, the W4A16 preset's), or ``w8a16`` symmetric int8 per channel. lm_head (tied to the
  embedding) stays bf16.
- ``measure`` (the project's venv): the bf16 engine on the original and on the quantized
  checkpoint in one process: batch-1 decode tokens/s of each (median of ``--repeats``, alternated),
  and, in transformers fp32 over the same weights, the mean per-token KL divergence of the
  quantized model's next-token distribution from the original's, and how often their top tokens
  agree, over the first ``--prompts`` fixed chat prompts of ``bench.logit_fidelity``,
  teacher-forced on the original's greedy continuation (``--tokens``).

Usage: ``$CT_VENV/bin/python -m bench.published_quantized make --scheme w4a16 --out DIR`` then
``python -m bench.published_quantized measure --quantized DIR [--prompts 16]
[--out bench/results/published_quantized.json]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch

from bench.report import write_report

SCHEMES = {"w4a16": (4, 64), "w8a16": (8, None)}  # bits, group size (None: per channel)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make(model: Path, out: Path, scheme: str) -> None:
    """The checkpoint at ``model`` compressed by compressed-tensors, written to ``out``."""
    from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from transformers import AutoModelForCausalLM

    bits, group = SCHEMES[scheme]
    args = QuantizationArgs(
        num_bits=bits, symmetric=True, strategy="group" if group else "channel", group_size=group
    )
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=args)}
    apply_quantization_config(hf, QuantizationConfig(config_groups=groups, ignore=["lm_head"]))
    for module in hf.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        w = module.weight.detach().float()
        g = w.view(w.shape[0], -1, group or w.shape[1])
        scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args)
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
    compressor = ModelCompressor.from_pretrained_model(hf, "pack-quantized")
    compressor.compress_model(hf)
    hf.save_pretrained(out)
    compressor.update_config(out)
    for name in TOKENIZER_FILES:
        if (model / name).is_file():
            shutil.copy(model / name, out / name)


def load_hf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager"
    ).eval()


def dequantized_model(original: Path, quantized: Path):
    """transformers' model of ``original`` in fp32 with ``quantized``'s projections as our
    reader dequantizes them (equal to the library's: tests/worker/test_quantized_checkpoints.py)."""
    from switchboard_kernels.quantized_weight import QuantizedWeight
    from worker.model.checkpoint_files import load_safetensors
    from worker.model.model_config import ModelConfig

    reader = ModelConfig.from_pretrained(quantized).quantization
    weights = load_safetensors(quantized, torch.float32, quantization=reader)
    model = load_hf(original, torch.float32)
    state = model.state_dict()
    for name, w in weights.items():
        if isinstance(w, QuantizedWeight):
            state[name] = w.dequantize()
    model.load_state_dict(state)
    return model


@torch.no_grad()
def kl_and_agreement(original: Path, quantized: Path, tokens: int, prompts: int) -> dict:
    from bench.logit_fidelity import PROMPTS, chat_ids
    from worker.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(original)
    p_model, q_model = load_hf(original, torch.float32), dequantized_model(original, quantized)
    kls, agree, count = [], 0, 0
    for text in PROMPTS[:prompts]:
        prompt = chat_ids(tokenizer, text)
        ids = p_model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False)
        p = torch.log_softmax(p_model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
        q = torch.log_softmax(q_model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
        kls.append(float((p.exp() * (p - q)).sum(-1).mean()))
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        count += p.shape[0]
    return {"mean_kl": statistics.mean(kls), "top1_agreement": agree / count, "tokens": count}


def decode_tok_s(llms: dict, prompt: list[int], tokens: int, repeats: int) -> dict:
    """Batch-1 decode tokens/s of each engine, alternated, median of ``repeats``."""
    from worker import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    runs: dict[str, list[float]] = {name: [] for name in llms}
    for llm in llms.values():  # warm
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))
    for _ in range(repeats):
        for name, llm in llms.items():
            start = time.perf_counter()
            llm.generate([prompt], params)
            runs[name].append(tokens / (time.perf_counter() - start))
    return {name: statistics.median(r) for name, r in runs.items()}


def measure(original: Path, quantized: Path, tokens: int, repeats: int, prompts: int) -> dict:
    from worker import LLM

    quality = kl_and_agreement(original, quantized, tokens, prompts)
    print(quality, flush=True)
    llms = {
        "bf16": LLM(original, dtype="bfloat16", max_loras=0),
        "published": LLM(quantized, dtype="bfloat16", max_loras=0),
    }
    prompt = list(range(100, 164))
    speed = decode_tok_s(llms, prompt, tokens, repeats)
    loadavg = Path("/proc/loadavg").read_text().split()[:3]
    return {
        "quantized": str(quantized),
        "decode_tok_s": speed,
        "speedup": speed["published"] / speed["bf16"],
        "quality": quality,
        "loadavg": loadavg,
    }


def main() -> None:
    from worker.model.default_model import resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["make", "measure"])
    parser.add_argument("--model", default=None, help="the original (default: SmolLM2-135M)")
    parser.add_argument("--scheme", choices=sorted(SCHEMES), default="w4a16")
    parser.add_argument("--out", default="bench/results/published_quantized.json")
    parser.add_argument("--quantized", default=None)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16, help="chat prompts for the KL")
    a = parser.parse_args()
    original = resolve_model_path(a.model)
    if a.command == "make":
        make(original, Path(a.out), a.scheme)
        return
    write_report(measure(original, Path(a.quantized), a.tokens, a.repeats, a.prompts), a.out)


if __name__ == "__main__":
    main()
