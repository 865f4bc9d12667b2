"""Draft-model proposer: a small Llama-family model with its own paged KV cache.

The draft runs the base model (no LoRA) on a shadow of each speculating sequence, held in
its own block manager. Each step it first catches up on the tokens the target accepted
since last time (its K/V for rejected drafts are rolled back), then decodes k tokens, all
speculating sequences batched in one forward pass per token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.core.batch import ScheduledSequence
from worker.core.block_manager import BlockManager
from worker.core.config import NUM_ALTERNATIVES
from worker.core.sequence import Sequence
from worker.errors import SpeculativeConfigError
from worker.model.llama import LlamaModel
from worker.model.model_runner import ModelRunner
from worker.sampling.rows import SamplingRow
from worker.spec_decode.draft_plan import StepPlan
from worker.spec_decode.draft_ranking import rank_rows
from worker.spec_decode.proposal import Proposal

# Beside a draft checkpoint: the token ids its output layer covers (`distill` writes it).
OUTPUT_VOCAB_FILE = "draft_vocab.json"
# Generated tokens past which the draft no longer takes up a sequence it has not followed.
TAKE_UP_WITHIN = 16
# An alternative (``Proposal.alternatives``) is offered only where the draft gives it at
# least this probability (the plan verifies those worth their rows; below 1% none is).
MIN_ALTERNATIVE_PROB = 0.01


class VocabularyMismatchError(SpeculativeConfigError):
    """The draft model does not share the target's vocabulary."""


def read_output_vocab(path: str | Path) -> torch.Tensor | None:
    """The token ids a draft proposes from (`OUTPUT_VOCAB_FILE`), or None: all of them.

    A draft that never proposes a token keeps speculation exact: the rejection sampler
    treats its probability as 0, and the target's residual distribution covers it."""
    file = Path(path) / OUTPUT_VOCAB_FILE
    if not file.exists():
        return None
    config = json.loads((Path(path) / "config.json").read_text())
    ids = json.loads(file.read_text())
    vocab = config.get("vocab_size", 0)
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and 0 <= i < vocab for i in ids)
        or len(set(ids)) != len(ids)
    ):
        raise SpeculativeConfigError(
            f"{file} must be a list of distinct token ids below the vocabulary size {vocab}"
        )
    return torch.tensor(sorted(ids), dtype=torch.long)


@dataclass(slots=True)
class _Shadow:
    seq: Sequence  # the draft's copy: its tokens, block table, computed count
    synced: int = 0  # leading tokens known to equal the target sequence's


class DraftProposer:
    ranks_candidates = True

    def __init__(
        self,
        path: str | Path,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_blocks: int,
        block_size: int,
        target_vocab_size: int,
        target_tokenizer=None,
        num_alternatives: int = NUM_ALTERNATIVES,
        min_alternative_prob: float = MIN_ALTERNATIVE_PROB,
        quantization: str | None = None,
    ) -> None:
        """``quantization``: "int8" or "int4" weights for the draft (see
        switchboard_kernels/linear)."""
        self.num_alternatives = num_alternatives
        self.min_alternative_prob = min_alternative_prob
        self.model = LlamaModel.from_pretrained(
            path,
            dtype=dtype,
            device=device,
            output_token_ids=read_output_vocab(path),
            quantization=quantization,
        )
        check_vocabulary(path, self.model.config.vocab_size, target_vocab_size, target_tokenizer)
        self.block_manager = BlockManager(
            num_blocks=num_blocks, block_size=block_size, enable_caching=False
        )
        self.runner = ModelRunner(self.model, num_blocks=num_blocks, block_size=block_size)
        self._shadows: dict[Sequence, _Shadow] = {}

    def release(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq, None)
        if shadow is not None:
            self.block_manager.free(shadow.seq.block_table)

    def may_draft_for(self, seq: Sequence) -> bool:
        """Sequences the draft follows already, and new ones within their first
        ``TAKE_UP_WITHIN`` generated tokens (a newcomer that starts paused probes after 8).

        Taking one up later means a prefill of its whole history on the draft, for the few
        tokens it has left: in bench.spec's grounded batch of 16, speculation (off above 8
        decoding sequences) came on for the last 8 at ~55 tokens each, and catching up on
        ~170 tokens each cost ~8% of the run and gained nothing."""
        return seq in self._shadows or len(seq.output_token_ids) <= TAKE_UP_WITHIN

    def propose(
        self,
        seqs: list[Sequence],
        ks: list[int],
        rows: list[SamplingRow],
        plan: StepPlan | None = None,
    ) -> list[Proposal]:
        """Up to ``ks[i]`` drafts each, one batched pass per depth; with a ``plan``, a
        sequence drafts one level deeper only while the plan says it is worth it."""
        proposals = [Proposal([]) for _ in seqs]
        # The k-th draft is never fed back, so the draft holds len(tokens) + k - 1 tokens.
        live = [i for i, s in enumerate(seqs) if self._prepare(s, s.num_tokens + ks[i] - 1)]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = live
        step = 0
        while active:
            shadows = [self._shadows[seqs[i]].seq for i in active]
            scheduled = [
                ScheduledSequence(s, s.num_computed_tokens, s.num_uncomputed_tokens)
                for s in shadows
            ]
            # [len(active), the draft's output columns]
            order, logits = self.runner.execute(scheduled, kept_only=True)
            # The runner reorders the batch (decodes first): map rows back by shadow.
            index = {id(s): i for s, i in zip(shadows, active, strict=True)}
            placed = [index[id(p.seq)] for p in order]
            ranked = rank_rows(
                logits,
                self.model.output_token_ids,
                self.model.full_logits,
                [rows[i] for i in placed],
                [proposals[i].token_ids for i in placed],
                count=self.num_alternatives,
                min_prob=self.min_alternative_prob,
            )
            for i, r, scheduled_seq in zip(placed, ranked, order, strict=True):
                shadow = scheduled_seq.seq
                shadow.num_computed_tokens = shadow.num_tokens
                proposal = proposals[i]
                proposal.token_ids.append(r.token)
                proposal.confidence.append(r.prob)
                proposal.alternatives.append(r.alternatives)
                proposal.alternative_probs.append(r.alternative_probs)
                shadow.tokens.append(r.token)
                if r.distribution is not None:
                    probs[i].append(r.distribution)
                if plan is not None:
                    plan.add(i, proposal)
            step += 1
            active = [i for i in active if step < ks[i]]
            if plan is not None:
                plan.pass_done()
                active = plan.continuing(active)
        for i in live:
            if probs[i]:
                proposals[i].probs = torch.stack(probs[i])
        return proposals

    def _prepare(self, seq: Sequence, num_tokens: int) -> bool:
        """Roll the shadow back to what still matches ``seq`` and make room for
        ``num_tokens``; False (shadow dropped) if the draft's cache is full."""
        shadow = self._shadows.get(seq)
        if shadow is None:
            shadow = _Shadow(Sequence(seq.request_id, [], seq.params, 0))
            self._shadows[seq] = shadow
        draft = shadow.seq
        common = shadow.synced
        limit = min(draft.num_computed_tokens, seq.num_tokens - 1)  # feed at least one
        while common < limit and draft.tokens[common] == seq.tokens[common]:
            common += 1
        draft.num_computed_tokens = common
        draft.tokens = list(seq.tokens)
        shadow.synced = common
        self.block_manager.trim(draft.block_table, common)
        if not self.block_manager.can_allocate(draft.block_table, num_tokens):
            self.release(seq)
            return False
        self.block_manager.allocate(draft.block_table, num_tokens)
        return True


def check_vocabulary(path, draft_vocab: int, target_vocab: int, target_tokenizer) -> None:
    """Refuse a draft whose token ids mean something else than the target's."""
    if draft_vocab != target_vocab:
        raise VocabularyMismatchError(
            f"the draft model at {path} has a vocabulary of {draft_vocab} tokens, the target "
            f"{target_vocab}: speculative decoding needs the same vocabulary"
        )
    if target_tokenizer is None:
        return
    from worker.text.tokenizer import load_tokenizer

    draft_tokenizer = load_tokenizer(path)
    if draft_tokenizer is not None and draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise VocabularyMismatchError(
            f"the draft model at {path} has a different tokenizer than the target: "
            "speculative decoding needs the same vocabulary"
        )
