"""A lone tenant's burst of prompts: short prefill steps, its running streams waiting a little.

When many prompts arrive at once (vLLM's ``bench serve`` sends its 64 together), each waits
for every prefill step before its own, so their mean time to first token is about half the
time all the prompts take, plus whatever else the steps carry. Two things lower it without
costing throughput (docs/engine.md has the measurement):

- Short steps. A step of ``chunk_tokens`` (512 by default) computes a prompt token about as
  cheaply as one of 2,048 on a CPU (a step's time grows in proportion to its tokens past a
  few hundred), and the prompts placed in it get their first tokens a quarter of a full
  step sooner; the mean over the burst falls with the step (shortest work first).
- Decodes wait for prompts. The running streams' decode rows cost a step as much as prompt
  tokens do, so while prompts wait the steps carry prompts only, and the decodes are placed
  once the prompt tokens computed since they last ran would pass ``max_step_tokens``: a
  stream waits no longer for its next token than behind one full step of prompts, which is
  what it waits today whenever a step is full.

Only while the prompts waiting hold more tokens than one full step computes (a burst: with
fewer, one ordinary step gives them all their first tokens, and skipping decodes for a few
arrivals at a time cost a closed loop throughput), and only while one tenant has work here
and all of it is interactive (the scheduler decides):
the trade is between that tenant's own first tokens and its own streams' pace, as every
step's size is. Other tenants' decodes are guarded by the decode step budget instead, and
batch work by its band.
"""

from __future__ import annotations

# At least this many prompts waiting for their first token make a burst: one prompt gains
# nothing from shorter steps (however long: its chunks are computed in turn anyway).
MIN_PROMPTS = 2


class BurstRule:
    """``chunk_tokens``: a burst step's token limit; ``max_step_tokens``: the scheduler's
    ``max_num_batched_tokens``, the prompt tokens decodes may wait behind."""

    def __init__(self, chunk_tokens: int, max_step_tokens: int) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"a burst's step needs at least one token, got {chunk_tokens}")
        self.chunk_tokens = min(chunk_tokens, max_step_tokens)
        self.max_step_tokens = max_step_tokens
        self.prompt_tokens_since_decodes = 0

    def is_burst(self, prompts: list[int]) -> bool:
        """Whether prompts waiting for their first token, with these many tokens still to
        compute, are a burst: at least ``MIN_PROMPTS`` of them, more tokens than one full
        step computes."""
        return len(prompts) >= MIN_PROMPTS and sum(prompts) > self.max_step_tokens

    def decodes_due(self) -> bool:
        """Whether this step places the running decodes: once another chunk of prompts
        would make them wait behind more than a full step's prompt tokens."""
        return self.prompt_tokens_since_decodes + self.chunk_tokens > self.max_step_tokens

    def placed(self, prompt_tokens: int, decodes: bool) -> None:
        """A burst step was placed: with the running decodes, or ``prompt_tokens`` more
        that they waited behind."""
        if decodes:
            self.prompt_tokens_since_decodes = 0
        else:
            self.prompt_tokens_since_decodes += prompt_tokens

    def ended(self) -> None:
        """The step is no burst's: the decodes ran (or none waited)."""
        self.prompt_tokens_since_decodes = 0
