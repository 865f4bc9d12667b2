"""A rank other than 0 of a tensor-parallel group: ``python -m worker.parallel.follower``.

Started by rank 0 (``worker.parallel.launch``) with a pickled ``FollowerSpec`` on stdin. It
loads its shard of the model, its KV cache and adapter slots, joins the group, then runs
its share of each step's forward pass as rank 0's messages arrive, until told to stop.
Anything that goes wrong ends the process with a non-zero status (its group then fails);
so does rank 0's death (its connection closes, or this process is orphaned).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import sys
import threading
import time

import torch
import torch.distributed as dist

from worker.parallel.launch import HOST, LOAD_TIMEOUT_S, FollowerSpec

logger = logging.getLogger("worker.parallel.follower")


def main() -> int:
    spec: FollowerSpec = pickle.load(sys.stdin.buffer)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank {spec.rank} %(levelname)s %(message)s"
    )
    _exit_when_orphaned()
    torch.set_num_threads(spec.threads)
    store = dist.TCPStore(
        HOST, spec.store_port, spec.size, is_master=False,
        timeout=datetime.timedelta(seconds=LOAD_TIMEOUT_S),
    )  # fmt: skip
    try:
        rank = _Rank(spec)
    except Exception as exc:
        logger.exception("loading this rank's shard failed")
        store.set(f"error/{spec.rank}", f"{type(exc).__name__}: {exc}")
        return 1
    store.set(f"ready/{spec.rank}", "1")
    rank.group.connect(store)
    try:
        rank.follow()
    except Exception:
        logger.exception("this rank failed; its group goes down with it")
        return 1
    rank.group.close()
    return 0


class _Rank:
    """This rank's shard of the model, its KV cache and adapter slots."""

    def __init__(self, spec: FollowerSpec) -> None:
        from worker.model.llama import LlamaModel
        from worker.model.lora_manager import LoraManager
        from worker.model.model_runner import ModelRunner
        from worker.model.parallel_group import TensorParallelGroup
        from worker.model.quantize_on_load import base_on_load
        from worker.model.sharding import Shard

        config = spec.config
        device = torch.device(spec.device)
        self.device = device
        self.group = TensorParallelGroup(Shard(spec.rank, spec.size), device)
        assert isinstance(config.dtype, torch.dtype) and config.num_kv_blocks is not None
        model = LlamaModel.from_pretrained(
            spec.model,
            dtype=config.dtype,
            device=device,
            group=self.group,
            linear_plan=spec.linear_plan,
            on_load=base_on_load(config),
        )
        self.lora_manager = None
        if config.max_loras > 0:
            self.lora_manager = LoraManager(
                spec.model,
                dtype=config.dtype,
                device=device,
                max_loras=config.max_loras,
                max_lora_rank=config.max_lora_rank,
                host_cache_bytes=int(config.lora_host_cache_gb * 2**30),
                shard=self.group.shard,
                on_load=base_on_load(config),
            )
        self.runner = ModelRunner(
            model,
            num_blocks=config.num_kv_blocks,
            block_size=config.block_size,
            lora_manager=self.lora_manager,
            num_host_blocks=config.num_host_blocks or 0,
        )

    @torch.inference_mode()
    def follow(self) -> None:
        """Each step as rank 0 sent it: its cache moves, slot fills, then the forward pass."""
        from worker.parallel.step_message import SlotCopy, receive

        while (message := receive(self.group)) is not None:
            for op in message.cache_ops:
                if isinstance(op, SlotCopy):
                    self.runner.copy_slots(op.src, op.dst)
                else:
                    self.runner.move_blocks(op)
            lora = None
            if self.lora_manager is not None:
                for slot, adapter_id, path in message.fills:
                    self.lora_manager.fill(slot, adapter_id, path)
                if message.token_slots is not None:
                    lora = self.lora_manager.batch(message.token_slots, message.all_decode)
            self.runner.run(message.inputs.to(self.device), lora)


def _exit_when_orphaned() -> None:
    """Exit if rank 0's process goes away without a word (this process is re-parented)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
