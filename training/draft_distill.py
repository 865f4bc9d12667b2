"""A draft model for speculative decoding, distilled from its target on this CPU.

The draft keeps the target's tokenizer, embeddings and final norm, a few of its decoder
layers, evenly spaced (DistilBERT's initialization, Sanh et al. 2019), and an output layer
cut down to the tokens the target says most (`OUTPUT_VOCAB_FILE` lists them; 8,192 cover
~93% of the default model's chat answers): for a small target the full 49,152-row output
layer would be most of the draft's cost. It is trained to match the target's next-token
distributions over those tokens (KL divergence, Hinton et al. 2015) on text the target
itself generates from a built-in set of instructions, so it learns to predict what the
target will say (as in DistillSpec, Zhou et al. 2024). The embeddings stay frozen.

The target's distributions are the ones it computed while generating (the engine reports
each answer token's `TEACHER_TOP` most likely tokens), so training runs the draft alone: a
teacher forward pass over every batch was 57% of a training step on an AMX Xeon (bf16) and
~70% on an AVX2-only CPU (fp32); recording costs ~15% of the generation's speed. Only the
answers are scored: the draft never proposes an instruction's tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.home import switchboard_home
from training.distill_prompts import TEMPLATES, TOPICS
from worker.engine.placement import resolve_dtype
from worker.sampling.sampling_params import SamplingParams
from worker.spec_decode.draft import OUTPUT_VOCAB_FILE

logger = logging.getLogger(__name__)

# The target's most likely next tokens recorded per position: the most the engine reports
# (OpenAI's limit); they hold ~90% of its probability on its own answers.
TEACHER_TOP = 20


@dataclass(slots=True)
class Corpus:
    """The token stream, and at each position the target's distribution over the next token
    as it generated it: its ``TEACHER_TOP`` most likely tokens and their raw log-probabilities,
    ids -1 where the target did not predict the next token (instructions, separators)."""

    tokens: torch.Tensor  # [n] int32
    teacher_ids: torch.Tensor  # [n, TEACHER_TOP] int32
    teacher_logprobs: torch.Tensor  # [n, TEACHER_TOP] float32

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(slots=True)
class DistillResult:
    path: Path
    generated_tokens: int
    train_steps: int
    first_loss: float  # KL(target || draft) of the first batch, before any update
    final_loss: float
    elapsed_s: float
    output_vocab: int  # tokens the draft's output layer covers


def default_draft_path(home: Path | None = None) -> Path:
    """Where ``switchboard draft distill`` puts the default model's draft."""
    return (home or switchboard_home()) / "models" / "SmolLM2-135M-Instruct-draft"


def corpus_requests(
    num_prompts: int, *, max_tokens: int, seed: int
) -> list[tuple[str, SamplingParams]]:
    """(instruction, sampling params) per answer: every instruction answered twice, greedily
    and sampled (the draft serves either kind); past that the instructions come round again,
    sampled only, since a greedy answer would repeat the first one."""
    first_round = 2 * len(TEMPLATES) * len(TOPICS)
    return [
        (
            TEMPLATES[(i // 2) % len(TEMPLATES)].format(
                TOPICS[(i // 2 // len(TEMPLATES)) % len(TOPICS)]
            ),
            SamplingParams(
                temperature=0.0 if i % 2 == 0 and i < first_round else 0.8,
                max_tokens=max_tokens,
                seed=seed + i,
                logprobs=TEACHER_TOP,
            ),
        )
        for i in range(num_prompts)
    ]


def corpus_cache_path(target: Path, *, num_prompts: int, max_tokens: int, seed: int) -> Path:
    """Where a generated corpus is kept: generating is most of a distillation's time, and a
    second one (another recipe, a longer training) from the same target and settings
    reads the same stream back. The key covers the target's files and the instructions."""
    key = {
        "target": str(target.resolve()),
        "files": sorted(
            (f.name, f.stat().st_size, f.stat().st_mtime_ns)
            for f in target.iterdir()
            if f.is_file()
        ),
        "requests": [
            (m, p.temperature, p.seed)
            for m, p in corpus_requests(num_prompts, max_tokens=max_tokens, seed=seed)
        ],
        "max_tokens": max_tokens,
        "teacher_top": TEACHER_TOP,
    }
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    return switchboard_home() / "cache" / "draft-corpus" / f"{digest}.safetensors"


def cached_corpus(target: Path, *, num_prompts: int, max_tokens: int, seed: int) -> Corpus:
    """``generate_corpus``, read from ``corpus_cache_path`` when it was generated before."""
    from safetensors.torch import load_file, save_file

    path = corpus_cache_path(target, num_prompts=num_prompts, max_tokens=max_tokens, seed=seed)
    if path.exists():
        logger.info("corpus read from %s", path)
        return Corpus(**load_file(path))
    corpus = generate_corpus(target, num_prompts=num_prompts, max_tokens=max_tokens, seed=seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    save_file(
        {
            "tokens": corpus.tokens,
            "teacher_ids": corpus.teacher_ids,
            "teacher_logprobs": corpus.teacher_logprobs,
        },
        partial,
    )
    partial.replace(path)
    return corpus


def generate_corpus(
    target: Path, *, num_prompts: int, max_tokens: int, seed: int, dtype: str = "auto"
) -> Corpus:
    """Instructions and the target's own answers (``corpus_requests``), each ended by one
    EOS, as one stream, with the target's distribution at every answer position."""
    from worker import LLM

    llm = LLM(target, dtype=dtype, max_num_seqs=64)
    tokenizer = llm.tokenizer
    requests = corpus_requests(num_prompts, max_tokens=max_tokens, seed=seed)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": m}], add_generation_prompt=True, tokenize=False
        )
        for m, _ in requests
    ]
    params = [p for _, p in requests]
    eos = tokenizer.eos_token_id
    tokens, ids, logprobs = [], [], []
    for out in llm.generate(texts, params, use_tqdm=True):
        answer = out.token_ids if out.token_ids[-1:] == [eos] else [*out.token_ids, eos]
        length = len(out.prompt_token_ids) + len(answer)
        # The last prompt token's distribution is the first answer token's, and so on.
        first = len(out.prompt_token_ids) - 1
        seq_ids = torch.full((length, TEACHER_TOP), -1, dtype=torch.int32)
        seq_logprobs = torch.zeros(length, TEACHER_TOP)
        top = [token.top_logprobs for token in out.logprobs]
        seq_ids[first : first + len(top)] = torch.tensor([[t for t, _ in row] for row in top])
        seq_logprobs[first : first + len(top)] = torch.tensor([[v for _, v in row] for row in top])
        tokens.append(torch.tensor([*out.prompt_token_ids, *answer], dtype=torch.int32))
        ids.append(seq_ids)
        logprobs.append(seq_logprobs)
    return Corpus(torch.cat(tokens), torch.cat(ids), torch.cat(logprobs))


def most_frequent_tokens(
    stream: torch.Tensor, *, size: int, vocab_size: int, eos: int
) -> torch.Tensor:
    """The ``size`` tokens that occur most in ``stream`` (EOS always), sorted by id."""
    counts = torch.bincount(stream.long(), minlength=vocab_size)
    counts[eos] = counts.max() + 1
    return torch.argsort(counts, descending=True, stable=True)[:size].sort().values


def build_draft(target_model, num_layers: int):
    """A ``num_layers``-layer copy of the target (evenly spaced layers) whose output layer
    is its own tensor (a copy of the target's, trained apart from the embeddings)."""
    from transformers import AutoModelForCausalLM

    config = target_model.config.__class__.from_dict(target_model.config.to_dict())
    total = config.num_hidden_layers
    picked = [round(i * (total - 1) / max(1, num_layers - 1)) for i in range(num_layers)]
    config.num_hidden_layers = num_layers
    config.tie_word_embeddings = False
    if hasattr(config, "layer_types") and config.layer_types is not None:
        config.layer_types = [config.layer_types[i] for i in picked]
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    source = target_model.state_dict()
    state = {}
    for name in draft.state_dict():
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            rest = name.split(".", 3)[3]
            state[name] = source[f"model.layers.{picked[index]}.{rest}"]
        elif name == "lm_head.weight":
            state[name] = source.get(name, source["model.embed_tokens.weight"]).clone()
        else:
            state[name] = source[name]
    draft.load_state_dict(state)
    return draft, picked


@dataclass(slots=True)
class TeacherTargets:
    """The recorded distributions in the draft's output columns, ready for the loss."""

    columns: torch.Tensor  # [n, TEACHER_TOP] int64: the draft's column of each token (0 if none)
    probs: torch.Tensor  # [n, TEACHER_TOP]: renormalized over the kept tokens, 0 elsewhere
    neg_entropy: torch.Tensor  # [n]: sum of probs * log(probs), KL's constant part


def teacher_targets(corpus: Corpus, keep: torch.Tensor | None, vocab_size: int) -> TeacherTargets:
    """Map the target's recorded tokens to the draft's output columns (``keep``: the ids
    they stand for; None: all ids) and renormalize its probabilities over those the draft
    can say, so the loss is a KL divergence between two distributions over its columns.
    A position with none of them scores nothing (its probs are all 0)."""
    if keep is None:
        column_of = torch.arange(vocab_size)
    else:
        column_of = torch.full((vocab_size,), -1, dtype=torch.long)
        column_of[keep] = torch.arange(len(keep))
    ids = corpus.teacher_ids.long()
    columns = torch.where(ids >= 0, column_of[ids.clamp(min=0)], -1)
    probs = torch.where(columns >= 0, corpus.teacher_logprobs.float().exp(), 0.0)
    mass = probs.sum(-1, keepdim=True)
    probs = torch.where(mass > 0, probs / mass.clamp(min=1e-30), 0.0)
    return TeacherTargets(columns.clamp(min=0), probs, torch.xlogy(probs, probs).sum(-1))


def recorded_kl(
    draft_logp: torch.Tensor, columns: torch.Tensor, probs: torch.Tensor, neg_entropy: torch.Tensor
) -> torch.Tensor:
    """KL(target || draft) over the target's recorded tokens, averaged over the positions
    that score (``teacher_targets``' rows for them; ``draft_logp``: the draft's
    log-probabilities over its columns, the same positions). At least one must score."""
    scored = (probs.sum(-1) > 0).sum()
    return (neg_entropy.sum() - (probs * draft_logp.gather(-1, columns)).sum()) / scored


def distill(
    target: Path,
    out: Path,
    *,
    num_layers: int = 4,
    num_prompts: int = 2304,
    max_tokens: int = 256,
    output_vocab: int = 8192,
    seq_len: int = 256,
    batch_size: int = 8,
    lr: float = 1e-3,
    epochs: int = 6,
    train_minutes: float = 25.0,
    seed: int = 0,
) -> DistillResult:
    """Generate, initialize, train for ``train_minutes`` (or ``epochs``), save to ``out``.

    ``output_vocab``: how many tokens the draft's output layer keeps (0: all)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    torch.manual_seed(seed)
    corpus = cached_corpus(target, num_prompts=num_prompts, max_tokens=max_tokens, seed=seed)
    logger.info("corpus of %d tokens ready after %.0f s", len(corpus), time.monotonic() - start)
    source = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    draft, picked = build_draft(source, num_layers)
    vocab_size = source.config.vocab_size
    logger.info("draft layers %s of the target's %d", picked, source.config.num_hidden_layers)
    del source
    keep = None
    if 0 < output_vocab < vocab_size:
        eos = AutoTokenizer.from_pretrained(target).eos_token_id
        keep = most_frequent_tokens(
            corpus.tokens, size=output_vocab, vocab_size=vocab_size, eos=eos
        )
    for name, param in draft.named_parameters():
        param.requires_grad = name.startswith("model.layers.") or name == "model.norm.weight"
    rows = keep if keep is not None else slice(None)
    head = torch.nn.Parameter(draft.lm_head.weight.detach()[rows].clone())
    trainable = [p for p in draft.parameters() if p.requires_grad] + [head]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    usable = len(corpus) // seq_len * seq_len
    chunks = corpus.tokens[:usable].long().view(-1, seq_len)
    targets = teacher_targets(corpus, keep, vocab_size)
    columns = targets.columns[:usable].view(-1, seq_len, TEACHER_TOP)
    probs = targets.probs[:usable].view(-1, seq_len, TEACHER_TOP)
    neg_entropy = targets.neg_entropy[:usable].view(-1, seq_len)
    max_steps = epochs * math.ceil(len(chunks) / batch_size)
    budget_s = train_minutes * 60
    train_start = time.monotonic()
    step, loss_value, first_loss = 0, float("nan"), float("nan")
    compute_dtype = resolve_dtype("auto")
    autocast = torch.autocast("cpu", dtype=compute_dtype, enabled=compute_dtype != torch.float32)
    draft.train()
    while step < max_steps and time.monotonic() - train_start < budget_s:
        order = torch.randperm(len(chunks))
        for i in range(0, len(order), batch_size):
            elapsed = time.monotonic() - train_start
            if step >= max_steps or elapsed >= budget_s:
                break
            # Warm up, then a cosine decay over whichever runs out first, time or steps.
            progress = max(elapsed / budget_s, step / max_steps)
            for group in optimizer.param_groups:
                warmup = min(1.0, (step + 1) / 20)
                group["lr"] = lr * warmup * 0.5 * (1 + math.cos(math.pi * progress))
            picked_chunks = order[i : i + batch_size]
            batch_probs = probs[picked_chunks]  # [batch, seq_len, TEACHER_TOP]
            if not batch_probs.any():
                continue  # instructions only: nothing to learn from
            with autocast:
                logits = draft.model(chunks[picked_chunks]).last_hidden_state @ head.T
            draft_logp = F.log_softmax(logits.float(), dim=-1)  # [batch, seq, kept vocab]
            loss = recorded_kl(
                draft_logp, columns[picked_chunks], batch_probs, neg_entropy[picked_chunks]
            )
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            step += 1
            loss_value = loss.item()
            if step == 1:
                first_loss = loss_value
            if step % 10 == 0:
                logger.info("step %d: KL %.3f", step, loss_value)
    with torch.no_grad():
        draft.lm_head.weight[rows] = head
    out.mkdir(parents=True, exist_ok=True)
    draft.eval().save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(target).save_pretrained(out)
    vocab_file = out / OUTPUT_VOCAB_FILE
    if keep is not None:
        vocab_file.write_text(json.dumps(keep.tolist()))
    else:
        vocab_file.unlink(missing_ok=True)
    elapsed = time.monotonic() - start
    kept = len(keep) if keep is not None else vocab_size
    return DistillResult(out, len(corpus), step, first_loss, loss_value, elapsed, kept)
