"""n > 1: samples of one prompt that wait for their first sibling's prefill, then fork.

The first sample computes the prompt; the others wait here by its request id. When its
prefill ends they fork from it (sharing its blocks, see ``Scheduler.fork``) and sample
their first tokens from the same logits row. A sample that leaves first hands its place
on: the next sibling computes the prompt instead (queued, sharing whatever is cached).
"""

from __future__ import annotations

import torch

from worker.core.batch import ScheduledSequence
from worker.core.scheduler import Scheduler
from worker.core.sequence import Sequence


class PendingForks:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._waiting: dict[str, list[Sequence]] = {}  # by the first sample's request id

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, first: Sequence, rest: list[Sequence]) -> None:
        """``rest`` wait for ``first``'s prompt."""
        if rest:
            self._waiting[first.request_id] = rest

    def join(
        self, sampling: list[ScheduledSequence], logits: torch.Tensor
    ) -> tuple[list[ScheduledSequence], torch.Tensor]:
        """Siblings of a sequence whose prompt just got computed join it here, each to
        sample its own first token from the same logits row."""
        rows = list(range(len(sampling)))
        added = []
        for row, s in enumerate(sampling):
            children = (
                self._waiting.pop(s.seq.request_id, None) if not s.seq.output_token_ids else None
            )
            for child in children or ():
                self.scheduler.fork(s.seq, child)
                child.prompt_logprobs = s.seq.prompt_logprobs  # one prompt, scored once
                added.append(ScheduledSequence(child, s.start, s.num_tokens))
                rows.append(row)
        if not added:
            return sampling, logits
        return sampling + added, logits[torch.tensor(rows, device=logits.device)]

    def release(self, seq: Sequence) -> None:
        """A sample leaving before its fork: drop it; if it was the one computing the
        prompt, the next sibling takes over (queued, sharing whatever is cached)."""
        children = self._waiting.pop(seq.request_id, None)
        if children:
            heir, rest = children[0], children[1:]
            self.scheduler.add(heir)
            if rest:
                self._waiting[heir.request_id] = rest
            return
        for parent_id, siblings in self._waiting.items():
            if seq in siblings:
                siblings.remove(seq)
                if not siblings:
                    del self._waiting[parent_id]
                return
