"""What rank 0 sends the other ranks each step, and how: one broadcast of pickled host data.

Rank 0 alone schedules; the others need only what the forward pass reads: the step's
flattened inputs (token ids, positions, the attention metadata: slot mapping, block tables,
masks), each token's adapter slot, the adapter slots rank 0 filled, and the KV cache moves
it made since the last step (swaps, copy-on-write, a draft's kept slots), replayed first in
the same order. Tensors travel as numpy arrays in a pickle; the message goes in one
broadcast of ``HEAD_BYTES`` on the group's control channel (a second one carries the rest
of a longer message), so a decode step costs one small collective.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass

import torch

from worker.core.batch import BlockMove
from worker.model.parallel_group import TensorParallelGroup
from worker.model.step_inputs import StepInputs

HEAD_BYTES = 16 * 1024  # covers a decode step of ~100 sequences
_LENGTH = 8  # bytes of the payload length at the head's start; 0 means "stop"


@dataclass(slots=True)
class SlotCopy:
    """A ``ModelRunner.copy_slots(src, dst)`` call: draft rows kept off their positions' slots."""

    src: list[int]
    dst: list[int]


CacheOp = list[BlockMove] | SlotCopy  # a ``move_blocks`` call, or a ``copy_slots`` one


@dataclass(slots=True)
class StepMessage:
    cache_ops: list[CacheOp]  # in the order rank 0 made them
    fills: list[tuple[int, str, str]]  # adapter slots filled: (slot, content id, path)
    inputs: StepInputs  # host tensors; ``order`` empty
    token_slots: list[int] | None  # each token's adapter slot (-1: none); None: no LoRA
    all_decode: bool


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            return torch.from_numpy, (obj.numpy(),)
        return NotImplemented


def encode(message: StepMessage | None) -> bytes:
    if message is None:
        return b""
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return out.getvalue()


def send(group: TensorParallelGroup, message: StepMessage | None) -> None:
    """Rank 0: broadcast ``message`` (None: the ranks stop)."""
    payload = encode(message)
    head = bytearray(HEAD_BYTES)
    head[:_LENGTH] = len(payload).to_bytes(_LENGTH, "little")
    first = min(len(payload), HEAD_BYTES - _LENGTH)
    head[_LENGTH : _LENGTH + first] = payload[:first]
    group.broadcast_bytes(torch.frombuffer(head, dtype=torch.uint8))
    if len(payload) > first:
        group.broadcast_bytes(torch.frombuffer(bytearray(payload[first:]), dtype=torch.uint8))


def receive(group: TensorParallelGroup) -> StepMessage | None:
    """The other ranks: the next message from rank 0 (None: stop)."""
    head = torch.empty(HEAD_BYTES, dtype=torch.uint8)
    group.broadcast_bytes(head)
    raw = head.numpy().tobytes()
    length = int.from_bytes(raw[:_LENGTH], "little")
    if length == 0:
        return None
    payload = raw[_LENGTH : _LENGTH + length]
    if length > len(payload):
        rest = torch.empty(length - len(payload), dtype=torch.uint8)
        group.broadcast_bytes(rest)
        payload += rest.numpy().tobytes()
    return pickle.loads(payload)
