"""One process's handle on its tensor-parallel group: its shard, device and collectives.

Built on ``torch.distributed``: NCCL for the forward pass's collectives when the model is
on GPUs, gloo on CPU. The step messages that rank 0 sends the others travel on a second,
gloo group (``control``) in host memory whatever the device, with a long timeout: an idle
rank waits there for the next step for as long as the worker is idle. A rank that dies
closes its connections, so a collective waiting on it fails at once; the forward pass's
own timeout bounds a rank that hangs instead.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from worker.model.sharding import Shard

logger = logging.getLogger(__name__)

# A forward-pass collective that waits this long has a peer that hangs.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
# Step messages: an idle worker's ranks wait this long for the next step.
IDLE_TIMEOUT = datetime.timedelta(days=365)


class TensorParallelGroup:
    """Rank ``shard.rank`` of ``shard.size``; ``connect`` joins the group (once per process)."""

    def __init__(self, shard: Shard, device: torch.device) -> None:
        self.shard = shard
        self.device = device
        self.control: dist.ProcessGroup | None = None

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def connect(self, store: dist.Store) -> None:
        """Join the group through ``store`` (every rank calls this; it returns when all did)."""
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend, store=store, rank=self.rank, world_size=self.size, timeout=COLLECTIVE_TIMEOUT
        )
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.control = None

    # --- the forward pass's collectives ----------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[rows, n] on each rank -> [rows, size * n]: the ranks' columns side by side."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor)
        return torch.cat(parts, dim=-1)

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """[rows, n] on each rank -> [rows, size * n] on rank 0 (None elsewhere)."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(tensor, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    # --- step messages (host bytes, on the control group) ----------------------------------

    def broadcast_bytes(self, buffer: torch.Tensor) -> None:
        """Broadcast a uint8 host tensor from rank 0 into the others' (same size)."""
        dist.broadcast(buffer, src=0, group=self.control)
