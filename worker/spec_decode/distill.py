"""A draft model for speculative decoding, distilled from its target on this CPU.

The draft keeps the target's tokenizer, embeddings, final norm and (tied) output head,
and a few of its decoder layers, evenly spaced (DistilBERT's initialization, Sanh et al.
2019). It is trained to match the target's next-token distributions (KL divergence, Hinton
et al. 2015) on text the target itself generates from a built-in set of instructions, so
it learns to predict what the target will say (as in DistillSpec, Zhou et al. 2024).
Embeddings and head stay frozen: they are most of the parameters, and already right.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from switchboard.home import switchboard_home
from worker.placement import resolve_dtype

logger = logging.getLogger(__name__)

TOPICS = [
    "volcanoes",
    "the history of bread",
    "how batteries work",
    "saving money",
    "chess openings",
    "the moon landing",
    "composting",
    "bees",
    "writing a cover letter",
    "the French revolution",
    "machine learning",
    "gardening in small spaces",
    "the immune system",
    "jazz music",
    "climate change",
    "how to train a puppy",
    "the Roman empire",
    "recycling plastic",
    "planning a trip",
    "black holes",
    "healthy breakfasts",
    "learning to code in Python",
    "earthquakes",
    "the printing press",
    "time management",
    "electric cars",
    "coffee",
    "the human heart",
    "public speaking",
    "rain forests",
    "sorting algorithms",
    "the ocean tides",
]
TEMPLATES = [
    "Tell me about {}.",
    "Write a short paragraph explaining {} to a child.",
    "What are the most important facts about {}?",
    "Give me a list of tips related to {}.",
    "Summarize the following in two sentences: {} is a topic many people find interesting, "
    "and it has a long history with many surprising details.",
]


@dataclass(slots=True)
class DistillResult:
    path: Path
    generated_tokens: int
    train_steps: int
    first_loss: float  # KL(target || draft) of the first batch, before any update
    final_loss: float
    elapsed_s: float


def default_draft_path(home: Path | None = None) -> Path:
    """Where ``switchboard draft distill`` puts the default model's draft."""
    return (home or switchboard_home()) / "models" / "SmolLM2-135M-Instruct-draft"


def generate_corpus(target: Path, *, num_prompts: int, max_tokens: int, seed: int) -> list[int]:
    """Prompts and the target's own sampled answers, EOS-separated, as one token stream."""
    from worker import LLM, SamplingParams

    llm = LLM(target, dtype="auto", max_num_seqs=64)
    tokenizer = llm.tokenizer
    messages = [
        TEMPLATES[i % len(TEMPLATES)].format(TOPICS[(i // len(TEMPLATES)) % len(TOPICS)])
        for i in range(num_prompts)
    ]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": m}], add_generation_prompt=True, tokenize=False
        )
        for m in messages
    ]
    # Greedy and sampled answers both: the draft serves either kind of request.
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.7, max_tokens=max_tokens, seed=seed + i)
        for i in range(num_prompts)
    ]
    stream: list[int] = []
    eos = tokenizer.eos_token_id
    for out in llm.generate(texts, params):
        stream += [*out.prompt_token_ids, *out.token_ids, eos]
    return stream


def build_draft(target_model, num_layers: int):
    """A ``num_layers``-layer copy of the target: evenly spaced layers, shared head."""
    from transformers import AutoModelForCausalLM

    config = target_model.config.__class__.from_dict(target_model.config.to_dict())
    total = config.num_hidden_layers
    picked = [round(i * (total - 1) / max(1, num_layers - 1)) for i in range(num_layers)]
    config.num_hidden_layers = num_layers
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
        else:
            state[name] = source[name]
    draft.load_state_dict(state)
    return draft, picked


def distill(
    target: Path,
    out: Path,
    *,
    num_layers: int = 4,
    num_prompts: int = 160,
    max_tokens: int = 160,
    seq_len: int = 256,
    batch_size: int = 4,
    lr: float = 3e-4,
    train_minutes: float = 10.0,
    seed: int = 0,
) -> DistillResult:
    """Generate, initialize, train for ``train_minutes`` (or 4 epochs), save to ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    torch.manual_seed(seed)
    stream = generate_corpus(target, num_prompts=num_prompts, max_tokens=max_tokens, seed=seed)
    logger.info("generated %d tokens in %.0f s", len(stream), time.monotonic() - start)
    teacher = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    draft, picked = build_draft(teacher, num_layers)
    # The teacher only runs forward: in bf16 where the CPU computes it natively (AMX is fast).
    teacher = teacher.to(resolve_dtype("auto"))
    logger.info("draft layers %s of the target's %d", picked, teacher.config.num_hidden_layers)
    for name, param in draft.named_parameters():
        param.requires_grad = name.startswith("model.layers.") or name == "model.norm.weight"
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    chunks = torch.tensor(stream[: len(stream) // seq_len * seq_len]).view(-1, seq_len)
    max_steps = 4 * math.ceil(len(chunks) / batch_size)
    deadline = time.monotonic() + train_minutes * 60
    step, loss_value, first_loss = 0, float("nan"), float("nan")
    draft.train()
    while step < max_steps and time.monotonic() < deadline:
        order = torch.randperm(len(chunks))
        for i in range(0, len(order), batch_size):
            if step >= max_steps or time.monotonic() >= deadline:
                break
            batch = chunks[order[i : i + batch_size]]  # [batch, seq_len]
            with torch.no_grad():
                target_logp = F.log_softmax(teacher(batch).logits.float(), dim=-1)
            draft_logp = F.log_softmax(draft(batch).logits, dim=-1)  # [batch, seq, vocab]
            loss = F.kl_div(
                draft_logp.flatten(0, 1),
                target_logp.flatten(0, 1),
                log_target=True,
                reduction="batchmean",
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
    out.mkdir(parents=True, exist_ok=True)
    draft.eval().save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(target).save_pretrained(out)
    elapsed = time.monotonic() - start
    return DistillResult(out, len(stream), step, first_loss, loss_value, elapsed)
