"""Rank 0's model runner under tensor parallelism: the engine's one code path, plus the send.

It is a ``ModelRunner`` over rank 0's shard whose ``execute`` prepares the step as usual,
broadcasts it (``worker.parallel.step_message``) and runs its share of the forward pass
while the other ranks run theirs; the logits come back here only, where the engine samples.
KV cache moves and copies run here at once and travel with the next step.

What can fail before the broadcast (an adapter that can no longer be read, say) fails as on
one rank: the engine isolates it. Once the ranks run a step, a failure leaves them out of
step: it fails the group (``TensorParallelError``, which the engine does not isolate).
"""

from __future__ import annotations

import dataclasses

import torch

from worker.core.batch import BlockMove, ScheduledSequence
from worker.model.llama import LlamaModel
from worker.model.model_runner import ModelRunner
from worker.parallel import step_message
from worker.parallel.launch import RankProcesses
from worker.parallel.step_message import CacheOp, SlotCopy, StepMessage


class TensorParallelRunner(ModelRunner):
    def __init__(self, model: LlamaModel, *, ranks: RankProcesses, **runner_options) -> None:
        super().__init__(model, **runner_options)
        self.ranks = ranks
        self._cache_ops: list[CacheOp] = []

    def move_blocks(self, moves: list[BlockMove]) -> None:
        super().move_blocks(moves)
        if moves:
            self._cache_ops.append(list(moves))

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        super().copy_slots(src, dst)
        self._cache_ops.append(SlotCopy(list(src), list(dst)))

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledSequence], *, kept_only: bool = False
    ) -> tuple[list[ScheduledSequence], torch.Tensor]:
        self.ranks.check()
        inputs = self.prepare(scheduled)
        lora = self.lora_batch(inputs)
        message = StepMessage(
            cache_ops=self._cache_ops,
            fills=self.lora_manager.take_fills() if self.lora_manager is not None else [],
            inputs=dataclasses.replace(inputs, order=[]),
            token_slots=lora.token_slots if lora is not None else None,
            all_decode=inputs.meta.all_decode,
        )
        self._cache_ops = []
        try:
            step_message.send(self.ranks.group, message)
            logits = self.run(inputs.to(self.device), lora)
        except Exception as exc:
            raise self.ranks.fail(exc) from exc
        assert logits is not None
        return [s for s in inputs.order if s.samples], logits
