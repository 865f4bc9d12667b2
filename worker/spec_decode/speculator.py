"""The engine's side of speculative decoding: propose before a step, verify after it.

Before scheduling, each decoding sequence the back-off policy allows gets up to k draft
tokens (``seq.spec_token_ids``; from a draft model, a chain and alternatives beside it, as
many as the step's plan finds worth verifying); the scheduler feeds them after the
sequence's last token,
so the target scores all k + 1 positions in the step's one forward pass, beside other
requests' prefills and decodes. After the pass, ``verify`` turns those k + 1 logits rows
into the tokens to emit, and ``commit`` rolls back the K/V slots of rejected drafts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.core.batch import ScheduledSequence
from worker.core.block_manager import BlockManager
from worker.core.sequence import Sequence, SequenceStatus
from worker.sampling.rows import SampledToken, SamplingRow
from worker.spec_decode import distributions as dist
from worker.spec_decode.backoff import BackoffPolicy
from worker.spec_decode.draft_plan import Selection
from worker.spec_decode.proposal import Proposal, Proposer
from worker.spec_decode.rejection_sampler import rejection_sample
from worker.spec_decode.stats import SpecDecodeStats


@dataclass(slots=True)
class Verified:
    seq: Sequence
    tokens: list[SampledToken]  # accepted drafts, then the target's own token


class Speculator:
    def __init__(
        self,
        proposer: Proposer,
        *,
        num_speculative_tokens: int,
        block_manager: BlockManager,
        max_model_len: int,
        policy: BackoffPolicy,
        copy_kv_slots: Callable[[list[int], list[int]], None],
    ) -> None:
        """``copy_kv_slots(src, dst)``: copies K/V between cache slots in every layer (the
        model runner's), for accepted alternatives."""
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.policy = policy
        self.stats = SpecDecodeStats()
        self._proposals: dict[Sequence, Proposal] = {}
        self._selections: dict[Sequence, Selection] = {}  # a draft model's, as planned
        # An accepted alternative's K/V: (slot offset it was written at, offset it belongs
        # at), both past the sequence's computed tokens; moved in ``commit``.
        self._moves: dict[Sequence, tuple[int, int]] = {}
        self.copy_kv_slots = copy_kv_slots
        # LongRoPE (``worker.engine.long_rope``): a sequence no longer than this drafts no row
        # past it, whose token would need the long factors while its K/V are short.
        self.rope_switch: int | None = None

    def propose(self, running: list[Sequence], rows: dict[str, SamplingRow]) -> None:
        """Give each decoding sequence that may speculate its draft tokens for this step."""
        self._proposals.clear()
        self._selections.clear()
        for seq in running:
            seq.clear_spec()
        decoding = [
            s
            for s in running
            # Past the prompt: a prompt's last token is sampled plainly, where n > 1 forks.
            if s.status is SequenceStatus.RUNNING
            and s.num_uncomputed_tokens == 1
            and s.output_token_ids
        ]
        if not decoding:
            return
        if not self.policy.allows_batch(len(decoding)):
            self.stats.num_backoff_steps += 1
            return
        if self.proposer.ranks_candidates:
            self._propose_ranked(decoding, rows)
        else:
            self._propose_chains(decoding, rows)

    def _propose_chains(self, decoding: list[Sequence], rows: dict[str, SamplingRow]) -> None:
        """A chain per sequence, as long as its moving acceptance makes worth it."""
        chosen, ks = [], []
        for seq in decoding:
            room = self._room(seq) if self.proposer.may_draft_for(seq) else 0
            k = self.policy.num_drafts(seq, room, len(decoding)) if room > 0 else 0
            if k > 0:
                chosen.append(seq)
                ks.append(k)
        if not chosen:
            return
        proposals = self.proposer.propose(chosen, ks, [rows[s.request_id] for s in chosen])
        for seq, proposal in zip(chosen, proposals, strict=True):
            if proposal.token_ids:
                seq.spec_token_ids = list(proposal.token_ids)
                self._proposals[seq] = proposal

    def _propose_ranked(self, decoding: list[Sequence], rows: dict[str, SamplingRow]) -> None:
        """A draft model's candidates, as deep and as many as the step's plan finds worth
        verifying (draft_plan): the chain's first drafts, then alternatives by depth."""
        ready = [
            s
            for s in decoding
            if self.proposer.may_draft_for(s) and self._room(s) > 0 and self.policy.may_draft(s)
        ]
        if not ready:
            return
        plan = self.policy.plan(ready, len(decoding))
        proposals = self.proposer.propose(
            ready, [self._room(s) for s in ready], [rows[s.request_id] for s in ready], plan
        )
        self.policy.observe_level_mass(plan.masses)
        for seq, proposal, selection in zip(ready, proposals, plan.select(), strict=True):
            if seq.grammar is not None:
                selection.alternatives.clear()  # a grammar masks a chain's rows only
            self.policy.planned(seq, selection)
            if selection.rows:
                chain = proposal.token_ids[: selection.chain]
                seq.spec_token_ids = chain + [t for _, t in selection.alternatives]
                # An alternative stands in for the chain's draft at its depth: it takes
                # that draft's position and sees what that draft sees.
                seq.spec_offsets = [*range(len(chain)), *(d for d, _ in selection.alternatives)]
                self._proposals[seq] = proposal
                self._selections[seq] = selection

    def _room(self, seq: Sequence) -> int:
        """Drafts this sequence may get: its request's k (at most the engine's), and no
        more than its length limits leave, since the step also emits a token of its own."""
        asked = seq.params.num_speculative_tokens
        k = self.k if asked is None else min(self.k, asked)
        left = min(
            seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens
        )
        room = min(k, left - 1)
        if self.rope_switch is not None and not seq.long_rope:
            # The row at position q scores token q + 1, as a sequence of q + 1 tokens does.
            room = min(room, self.rope_switch - seq.num_tokens)
        return max(0, room)

    def verify(
        self,
        sampling: list[ScheduledSequence],
        logits: torch.Tensor,
        rows: dict[str, SamplingRow],
        step_seconds: float | None = None,
    ) -> tuple[list[ScheduledSequence], torch.Tensor, list[Verified]]:
        """Split the step's logits: plain rows (one per sequence, for the sampler) and the
        verified tokens of every speculating sequence. ``step_seconds``: the target's
        forward pass, timed, for a step of decodes only (else None)."""
        if step_seconds and sampling:
            fed = sum(s.num_spec for s in sampling)
            self.policy.observe_step(len(sampling), fed, step_seconds)
        plain, plain_rows, verified = [], [], []
        row = 0
        for s in sampling:
            if s.num_spec == 0:
                plain.append(s)
                plain_rows.append(row)
                row += 1
                continue
            block = logits[row : row + s.num_spec + 1]  # [num_spec + 1, vocab]
            row += s.num_spec + 1
            tokens = self._verify_one(s.seq, s.num_spec, block, rows[s.seq.request_id])
            verified.append(Verified(s.seq, tokens))
        if len(plain) != len(sampling):
            logits = logits[torch.tensor(plain_rows, dtype=torch.int64, device=logits.device)]
        return plain, logits, verified

    def _verify_one(
        self, seq: Sequence, num_spec: int, logits: torch.Tensor, row: SamplingRow
    ) -> list[SampledToken]:
        """Rows of ``logits``: the last real token, the chain's drafts, the alternatives."""
        proposal = self._proposals.pop(seq)
        # The chain comes first, the alternatives after it (offsets alone cannot tell a
        # depth-0 alternative from the chain's first draft: both sit at offset 0).
        selection = self._selections.get(seq)
        num_alternatives = len(selection.alternatives) if selection is not None else 0
        chain = min(num_spec, len(seq.spec_token_ids) - num_alternatives)
        alt_depths = seq.draft_offsets(num_spec)[chain:]
        drafts = seq.spec_token_ids[:chain]
        rows = dist.position_rows(row, drafts)
        x = dist.processed_logits(logits[: chain + 1], rows)  # [chain + 1, vocab]
        if dist.is_greedy(row):
            # Greedy: accept exactly the drafts that equal the target's argmax.
            best = dist.argmax(x)
            n = 0
            while n < chain and drafts[n] == best[n]:
                n += 1
            token = best[n]
        else:
            p = dist.probabilities(x, rows)
            q = proposal.probs[:chain].unsqueeze(0) if proposal.probs is not None else None
            u = torch.rand(1, chain + 1, dtype=torch.float64, generator=row.generator)
            verdict = rejection_sample(
                p.unsqueeze(0), torch.tensor([drafts], dtype=torch.int64), q, u
            )
            n = int(verdict.num_accepted[0])
            token = int(verdict.next_token[0])
        emitted, logit_rows = [*drafts[:n], token], list(range(n + 1))
        # The chain broke at draft n and the target's token there (distributed exactly as
        # the target's, whatever the drafts were) is one of n's alternatives: that row
        # holds the target's distribution after it, so the step keeps one more token.
        alternatives = seq.spec_token_ids[chain:num_spec]
        hit = next(
            (
                i
                for i, (depth, alt) in enumerate(zip(alt_depths, alternatives, strict=True))
                if depth == n and alt == token
            ),
            None,
        )
        if hit is not None:
            alt_row = chain + 1 + hit
            after, _, _ = dist.next_token(logits[alt_row], row, [*drafts[:n], token])
            emitted.append(after)
            logit_rows.append(alt_row)
            self._moves[seq] = (chain + hit, n)
        selection = self._selections.pop(seq, None)
        if selection is not None:
            self.policy.calibrate(seq, selection, len(emitted) - 1)
        self.stats.record(chain, n, alternatives=len(alt_depths), alternative_hit=hit is not None)
        self.policy.update(
            seq, chain, n, alternatives=len(alt_depths), alternative_hit=hit is not None
        )
        return _with_logprobs(emitted, logits, logit_rows, seq.params.logprobs)

    def commit(self, seq: Sequence, num_emitted: int) -> None:
        """After the emitted tokens were appended: the accepted drafts' K/V count as
        computed (the last emitted token has none yet); rejected drafts' slots go. An
        accepted alternative's K/V first moves to its place after the accepted drafts."""
        move = self._moves.pop(seq, None)
        if move is not None:
            base = seq.num_computed_tokens  # the slot of the chain's first draft
            src, dst = (self._slot(seq, base + offset) for offset in move)
            self.copy_kv_slots([src], [dst])
        seq.num_computed_tokens += num_emitted - 1
        seq.clear_spec()
        self.block_manager.trim(seq.block_table, seq.num_computed_tokens)

    def _slot(self, seq: Sequence, index: int) -> int:
        size = self.block_manager.block_size
        return seq.block_table[index // size] * size + index % size

    def release(self, seq: Sequence) -> None:
        seq.clear_spec()
        self._proposals.pop(seq, None)
        self._selections.pop(seq, None)
        self._moves.pop(seq, None)
        self.proposer.release(seq)
        self.policy.release(seq)


def _with_logprobs(
    token_ids: list[int], logits: torch.Tensor, rows: list[int], num_top: int | None
) -> list[SampledToken]:
    """The emitted tokens, with raw-logit logprobs (as the sampler reports) if asked; token
    j was chosen from ``logits[rows[j]]``."""
    if num_top is None:
        return [SampledToken(t, None, None) for t in token_ids]
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    top = torch.topk(logprobs, num_top, dim=-1) if num_top else None
    out = []
    for j, t in enumerate(token_ids):
        alternatives = []
        if top is not None:
            alternatives = list(zip(top.indices[j].tolist(), top.values[j].tolist(), strict=True))
        out.append(SampledToken(t, float(logprobs[j, t]), alternatives))
    return out
