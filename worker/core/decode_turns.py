"""Decode rows under a step budget: a tenant decoding more rows than its share takes turns.

So a quiet tenant's decodes keep their pace beside a flood's, whose streams take turns; only
time is taken from the flood, not work: its rows wait a step, holding their KV blocks.
"""

from __future__ import annotations

from worker.core.fairness import ServiceLedger, split_rows
from worker.core.sequence import Sequence
from worker.core.step_budget import DecodeStepBudget


class DecodeTurns:
    """Which running decodes a step places, by tenant weight, keeping each row's last turn."""

    def __init__(self, ledger: ServiceLedger) -> None:
        self.ledger = ledger
        self.num_turns = 0  # decodes placed in turns so far

    def within_budget(
        self, decodes: list[Sequence], budget: DecodeStepBudget | None
    ) -> list[Sequence]:
        """Fair, with a step budget: when the decodes alone would take more tokens than the
        budget allows and more than one tenant decodes, the rows the budget allows are split
        between those tenants by weight (``split_rows``: one asking for fewer than its share
        gets them all); a tenant over its share has its rows that waited longest placed and
        the others wait a step. Decodes carrying drafts are always placed (their drafts were
        proposed for this step)."""
        if budget is None or not self.ledger.fair or len(decodes) < 2:
            return decodes
        cap = budget.token_cap()
        if cap is None or len(decodes) <= cap:
            return decodes
        by_tenant: dict[str, list[Sequence]] = {}
        for seq in decodes:
            by_tenant.setdefault(seq.tenant, []).append(seq)
        if len(by_tenant) < 2:
            return decodes
        weights = {t: self.ledger.accounts[t].weight for t in by_tenant}
        rows = split_rows({t: len(seqs) for t, seqs in by_tenant.items()}, weights, cap)
        placed: list[Sequence] = []
        for tenant, seqs in by_tenant.items():
            if rows[tenant] >= len(seqs):
                placed.extend(seqs)
                continue
            # Round robin: least recently placed first, then arrival order (``seqs`` is in
            # arrival order).
            ranked = sorted(seqs, key=lambda s: (not s.spec_token_ids, s.last_decode_turn))
            kept = max(rows[tenant], sum(1 for s in seqs if s.spec_token_ids))
            for seq in ranked[:kept]:
                self.num_turns += 1  # a queue: placed in this order, so in turn again
                seq.last_decode_turn = self.num_turns
                placed.append(seq)
        placed.sort(key=lambda s: s.arrival_order)
        return placed
