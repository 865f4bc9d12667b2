"""Fair service across tenants: the Virtual Token Counter (Sheng et al., OSDI 2024).

Each tenant has a counter of the service it has received: weighted tokens over its weight.
A prefill token counts ``prefill_weight`` and a decoded token (or a draft token verified)
``decode_weight``, the paper's 1 and 2. The scheduler serves the lowest counter first:
admissions, the split of a step's token budget between prefill chunks, and whom to preempt.
A tenant that arrives with nothing here starts no lower than the lowest counter of the
tenants that have work (the paper's counter lift), so idle time is not banked as credit.

Our variant counts tokens computed, not tokens sent: a prefix-cache hit costs nothing, a prompt
position scored for its logprobs costs its scoring too (``worker.core.prompt_scoring``), and
a recompute after preemption is not charged twice (``Sequence.num_charged_tokens``), since
the counter measures the compute a tenant took from the others. While another tenant waits,
a tenant holds at most its weighted share of the seats and KV blocks; past it, it is the
first preempted, and a waiting tenant under its share may take room from it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.core.config import FairnessConfig, SchedulingPolicy
from worker.core.prompt_scoring import work_tokens
from worker.core.sequence import Sequence

if TYPE_CHECKING:
    from worker.core.batch import ScheduledSequence

# Queue-time and first-token histogram buckets (seconds) kept per tenant for /metrics.
QUEUE_TIME_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, math.inf)
# Accounts of idle tenants are kept (a counter must survive a short pause, or leaving and
# coming back would wipe it); past this many, those no higher than the floor are dropped.
MAX_IDLE_ACCOUNTS = 4096
# Weights are relative; bounded so that no tenant's counter stands still or races (the
# gateway's bounds are the same: gateway.tenancy.weights).
MIN_TENANT_WEIGHT = 0.001
MAX_TENANT_WEIGHT = 1000.0


@dataclass(slots=True)
class TenantAccount:
    weight: float = 1.0
    counter: float = 0.0  # weighted tokens served / weight
    num_seqs: int = 0  # unfinished sequences here (waiting, running or swapped)
    prefill_tokens: int = 0  # since start, for metrics (scored prompt positions at their cost)
    decode_tokens: int = 0
    queue_time_sum: float = 0.0
    queue_time_buckets: list[int] = field(default_factory=lambda: [0] * len(QUEUE_TIME_BUCKETS))
    first_token_sum: float = 0.0  # arrival at the engine to the first token
    first_token_buckets: list[int] = field(default_factory=lambda: [0] * len(QUEUE_TIME_BUCKETS))


@dataclass(frozen=True, slots=True)
class TenantService:
    """One tenant's totals, as a snapshot for metrics."""

    tenant: str
    weight: float
    counter: float
    prefill_tokens: int
    decode_tokens: int
    queue_time_sum: float
    queue_time_buckets: tuple[int, ...]  # cumulative counts per QUEUE_TIME_BUCKETS bound
    first_token_sum: float = 0.0
    first_token_buckets: tuple[int, ...] = ()  # the same, from arrival to the first token


class ServiceLedger:
    """The counters, and the per-tenant questions the scheduler asks of them."""

    def __init__(self, config: FairnessConfig) -> None:
        self.config = config
        # A prompt position scored for its logprobs counts as this many prefill tokens.
        self.scored_token_cost = 1.0
        self.accounts: dict[str, TenantAccount] = {}
        self._last_left = 0.0  # counter of the last tenant to run out of work

    @property
    def fair(self) -> bool:
        return self.config.policy is SchedulingPolicy.FAIR

    def join(self, seq: Sequence) -> None:
        """``seq`` is now queued or running here; lift its tenant if it had no work."""
        account = self.accounts.get(seq.tenant)
        if account is None:
            account = self.accounts[seq.tenant] = TenantAccount()
            if len(self.accounts) > MAX_IDLE_ACCOUNTS:
                self._drop_idle()
        if account.num_seqs == 0:
            active = [a.counter for a in self.accounts.values() if a.num_seqs > 0]
            account.counter = max(account.counter, min(active) if active else self._last_left)
        account.weight = seq.tenant_weight
        account.num_seqs += 1

    def leave(self, seq: Sequence) -> None:
        account = self.accounts[seq.tenant]
        account.num_seqs -= 1
        if account.num_seqs == 0:
            self._last_left = account.counter

    def cost(self, seq: Sequence, start: int, num_tokens: int, num_spec: int) -> tuple[int, int]:
        """(prefill, decode) tokens not charged before, of computing ``seq.tokens[start:
        start + num_tokens]`` plus ``num_spec`` drafts."""
        begin = max(start, seq.num_charged_tokens)
        end = start + num_tokens
        prompt_end = seq.num_prompt_tokens
        prefill = max(0, min(end, prompt_end) - begin)
        decode = max(0, end - max(begin, prompt_end)) + num_spec
        if prefill and seq.params.prompt_logprobs is not None:  # its scoring's share
            prefill = work_tokens(seq, begin, prefill, self.scored_token_cost)
        return prefill, decode

    def virtual(self, tenant: str, prefill: int, decode: int) -> float:
        """What that many tokens add to the tenant's counter."""
        cfg = self.config
        weight = self.accounts[tenant].weight
        return (cfg.prefill_weight * prefill + cfg.decode_weight * decode) / weight

    def charge(self, costs: list[tuple[ScheduledSequence, int, int]]) -> None:
        """Add a step's placed work, each piece with its (prefill, decode) ``cost``, to its
        tenants' counters: each tenant's tokens are summed first, so a step of many decodes
        touches each account once."""
        totals: dict[str, tuple[int, int]] = {}
        for placed, prefill, decode in costs:
            seq = placed.seq
            before = totals.get(seq.tenant, (0, 0))
            totals[seq.tenant] = (before[0] + prefill, before[1] + decode)
            seq.num_charged_tokens = max(seq.num_charged_tokens, placed.start + placed.num_tokens)
        for tenant, (prefill, decode) in totals.items():
            account = self.accounts[tenant]
            account.counter += self.virtual(tenant, prefill, decode)
            account.prefill_tokens += prefill
            account.decode_tokens += decode

    def counter(self, tenant: str) -> float:
        return self.accounts[tenant].counter

    def record_queue_time(self, tenant: str, seconds: float) -> None:
        account = self.accounts[tenant]
        account.queue_time_sum += seconds
        account.queue_time_buckets[bisect.bisect_left(QUEUE_TIME_BUCKETS, seconds)] += 1

    def record_first_token(self, tenant: str, seconds: float) -> None:
        """A request's time from arrival at the engine to its first token (the engine's own
        TTFT: what a client sees beyond it is the serving path's)."""
        account = self.accounts.get(tenant)
        if account is None:  # dropped while idle; the request is done with it anyway
            return
        account.first_token_sum += seconds
        account.first_token_buckets[bisect.bisect_left(QUEUE_TIME_BUCKETS, seconds)] += 1

    def shares(self) -> dict[str, float]:
        """Each tenant with work here: its weight over the sum of theirs."""
        active = {t: a.weight for t, a in self.accounts.items() if a.num_seqs > 0}
        total = sum(active.values())
        return {t: w / total for t, w in active.items()}

    def snapshot(self) -> tuple[TenantService, ...]:
        out = []
        for tenant, a in sorted(self.accounts.items()):
            out.append(
                TenantService(
                    tenant,
                    a.weight,
                    a.counter,
                    a.prefill_tokens,
                    a.decode_tokens,
                    a.queue_time_sum,
                    tuple(itertools.accumulate(a.queue_time_buckets)),
                    a.first_token_sum,
                    tuple(itertools.accumulate(a.first_token_buckets)),
                )
            )
        return tuple(out)

    def _drop_idle(self) -> None:
        active = [a.counter for a in self.accounts.values() if a.num_seqs > 0]
        floor = min(active) if active else self._last_left
        for tenant in [t for t, a in self.accounts.items() if a.num_seqs == 0]:
            if self.accounts[tenant].counter <= floor:
                del self.accounts[tenant]


class StepCharges:
    """This step's tokens per tenant so far, so that the next pick sees them; charged to
    the ledger once the step is scheduled (``commit``)."""

    def __init__(self, ledger: ServiceLedger) -> None:
        self.ledger = ledger
        self._tokens: dict[str, tuple[int, int]] = {}  # tenant -> (prefill, decode) so far
        self._costs: list[tuple[ScheduledSequence, int, int]] = []

    def note(self, placed: ScheduledSequence) -> ScheduledSequence:
        seq = placed.seq
        prefill, decode = self.ledger.cost(seq, placed.start, placed.num_tokens, placed.num_spec)
        self._costs.append((placed, prefill, decode))
        before = self._tokens.get(seq.tenant, (0, 0))
        self._tokens[seq.tenant] = (before[0] + prefill, before[1] + decode)
        return placed

    def extra(self, tenant: str) -> float:
        """What this step's tokens so far add to the tenant's counter."""
        tokens = self._tokens.get(tenant)
        return 0.0 if tokens is None else self.ledger.virtual(tenant, *tokens)

    def commit(self, scheduled: list[ScheduledSequence]) -> None:
        """Charge the ledger for the noted work still in ``scheduled`` (a sequence
        preempted after it was placed gives its place back)."""
        costs = self._costs
        if len(costs) != len(scheduled):
            kept = {id(placed) for placed in scheduled}
            costs = [c for c in costs if id(c[0]) in kept]
        self.ledger.charge(costs)

    def lowest(self, queues: dict[str, deque[Sequence]], running: list[Sequence]) -> str:
        """The tenant to serve next: lowest counter, then fewest seats held (a newcomer
        lifted to an equal counter goes first), then the earliest head of queue."""
        seats: dict[str, int] = {}
        for s in running:
            seats[s.tenant] = seats.get(s.tenant, 0) + 1
        return min(
            queues,
            key=lambda t: (
                self.ledger.counter(t) + self.extra(t),
                seats.get(t, 0),
                queues[t][0].arrival_order,
            ),
        )


class Shares:
    """What each tenant's running sequences hold (seats, KV blocks) against its share of
    them: the weight over the weights of the tenants with work here."""

    def __init__(
        self, ledger: ServiceLedger, running: list[Sequence], max_seats: int, num_blocks: int
    ) -> None:
        self.ledger = ledger
        self.running = running
        self.max_seats = max_seats
        self.num_blocks = num_blocks
        self.shares = ledger.shares()
        self.held: dict[str, tuple[int, int]] = {}
        for s in running:
            seats, blocks = self.held.get(s.tenant, (0, 0))
            self.held[s.tenant] = (seats + 1, blocks + len(s.block_table))

    def over(self, tenant: str) -> float:
        """The larger of its seats and its blocks over its share of them (above 1: over)."""
        seats, blocks = self.held.get(tenant, (0, 0))
        share = self.shares[tenant]
        return max(seats / (share * self.max_seats), blocks / (share * self.num_blocks))

    def victim(self) -> Sequence:
        """Whom to preempt: the latest arrival of the tenant furthest over its share (ties:
        the one served most)."""
        over = {t: self.over(t) for t in self.held}
        return max(
            self.running,
            key=lambda s: (over[s.tenant], self.ledger.counter(s.tenant), s.arrival_order),
        )

    def room_for(self, seq: Sequence, num_blocks: int) -> Sequence | None:
        """A sequence to preempt so that ``seq`` (a seat and ``num_blocks`` blocks) can
        start: only if its tenant stays within its share, from a tenant over its own."""
        seats, blocks = self.held.get(seq.tenant, (0, 0))
        share = self.shares[seq.tenant]
        if seats + 1 > max(1.0, share * self.max_seats) or (
            blocks + num_blocks > share * self.num_blocks
        ):
            return None
        over = {t: self.over(t) for t in self.held if t != seq.tenant}
        tenant = max(over, key=lambda t: over[t], default=None)
        if tenant is None or over[tenant] <= 1.0:
            return None
        return max((s for s in self.running if s.tenant == tenant), key=lambda s: s.arrival_order)


def split_rows(demand: dict[str, int], weights: dict[str, float], total: int) -> dict[str, int]:
    """``total`` rows split between tenants by weight, max-min fair (water-filling): a tenant
    asking for no more than its share gets all it asks, and what it leaves is split between
    the others by weight again. Each tenant that asks gets at least one row (``total`` is
    raised to the number of tenants if below it). Whole rows: the remainder goes to the
    largest fractions, ties to the tenant asking most."""
    rows = dict.fromkeys(demand, 0)
    left = max(total, sum(1 for n in demand.values() if n > 0))
    active = {t for t, n in demand.items() if n > 0}
    while active and left > 0:
        weight = sum(weights.get(t, 1.0) for t in active)
        fair = {t: left * weights.get(t, 1.0) / weight for t in active}
        within = {t for t in active if demand[t] <= fair[t]}
        if not within:
            whole = {t: max(1, math.floor(fair[t])) for t in active}
            spare = left - sum(whole.values())
            by_fraction = sorted(active, key=lambda t: (whole[t] - fair[t], -demand[t], t))
            for t in by_fraction[: max(spare, 0)]:
                whole[t] += 1
            for t in active:
                rows[t] = min(demand[t], whole[t])
            return rows
        for t in within:
            rows[t] = demand[t]
            left -= demand[t]
        active -= within
    return rows
