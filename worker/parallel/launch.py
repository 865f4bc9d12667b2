"""Rank 0's side of a tensor-parallel group: it starts the other ranks, watches and stops them.

Ranks 1..N-1 run as child processes (``python -m worker.parallel.follower``), each loading
its own shard while rank 0 loads its one; they meet on a ``TCPStore`` that rank 0 opens on a
free port of 127.0.0.1, and join the group once every rank has loaded (a rank that fails
to load reports why through the store). On CPU the ranks share the machine's cores: each
runs ``cores // N`` threads (rank 0 too, restored when the group stops).

A rank that dies takes the group down: a thread per child waits on its process, and when
one exits unasked (or a collective fails) the group is marked failed, the other children
are killed, and the ``on_failure`` callbacks run (the worker leaves the registry and exits
non-zero). Every later step raises ``TensorParallelError``.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from switchboard_kernels.linear_choice import LinearPlan
from worker.core.config import EngineConfig, SpeculativeConfig
from worker.errors import TensorParallelError
from worker.model.model_config import ModelConfig
from worker.model.parallel_group import TensorParallelGroup
from worker.model.sharding import Shard, check_divisible

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
LOAD_TIMEOUT_S = 1800.0  # loading a shard of a large checkpoint from slow disks
STOP_TIMEOUT_S = 10.0
_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class FollowerSpec:
    """What a rank other than 0 needs to start: pickled to its stdin."""

    rank: int
    size: int
    store_port: int
    model: str
    config: EngineConfig  # dtype, num_kv_blocks and num_host_blocks resolved by rank 0
    device: str
    threads: int
    linear_plan: LinearPlan | None = None  # rank 0's projections' kernels


def start_ranks(
    model: str | Path,
    config: EngineConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    num_kv_blocks: int,
    num_host_blocks: int | None,
    linear_plan: LinearPlan | None = None,
) -> RankProcesses | None:
    """Ranks 1..N-1 of ``config.tensor_parallel_size`` started, loading their shards with
    rank 0's resolved sizes (no speculation: the draft runs on rank 0 alone); None for N = 1.
    A model the group cannot split is refused first."""
    if config.tensor_parallel_size == 1:
        return None
    check_divisible(ModelConfig.from_pretrained(model), config.tensor_parallel_size)
    resolved = dataclasses.replace(
        config,
        dtype=dtype,
        num_kv_blocks=num_kv_blocks,
        num_host_blocks=num_host_blocks,
        speculative=SpeculativeConfig(),
    )
    return RankProcesses.start(model, resolved, device=device, linear_plan=linear_plan)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU, or the ``rank``-th GPU from ``device``'s index."""
    if device.type == "cpu":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def threads_per_rank(size: int) -> int:
    """The machine's cores (those this process may use) shared evenly by ``size`` ranks."""
    return max(1, len(os.sched_getaffinity(0)) // size)


class RankProcesses:
    """The ranks 1..N-1 of rank 0's group. ``start`` spawns them; ``connect`` (after rank 0
    loaded its shard) waits for them and joins the group; ``shutdown`` stops them."""

    def __init__(self, group: TensorParallelGroup, store: dist.TCPStore) -> None:
        self.group = group
        self._store = store
        self._procs: dict[int, subprocess.Popen] = {}
        self._stopping = False
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[TensorParallelError], None]] = []
        self.failure: TensorParallelError | None = None
        self._threads_before: int | None = None

    @classmethod
    def start(
        cls,
        model: str | Path,
        config: EngineConfig,
        *,
        device: torch.device,
        linear_plan: LinearPlan | None = None,
    ) -> RankProcesses:
        """Spawn ranks 1..N-1 (N = ``config.tensor_parallel_size``) loading their shards."""
        size = config.tensor_parallel_size
        if dist.is_initialized():
            raise TensorParallelError(
                "this process already belongs to a torch.distributed group: one "
                "tensor-parallel engine per process (shut the other one down first)"
            )
        store = dist.TCPStore(
            HOST, 0, size, is_master=True, timeout=datetime.timedelta(seconds=LOAD_TIMEOUT_S),
            wait_for_workers=False,
        )  # fmt: skip
        ranks = cls(TensorParallelGroup(Shard(0, size), rank_device(device, 0)), store)
        threads = threads_per_rank(size)
        if device.type == "cpu":
            ranks._threads_before = torch.get_num_threads()
            torch.set_num_threads(threads)
        env = os.environ | {
            "PYTHONPATH": os.pathsep.join([str(_REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": str(threads),
        }
        for rank in range(1, size):
            spec = FollowerSpec(
                rank=rank,
                size=size,
                store_port=store.port,
                model=str(model),
                config=config,
                device=str(rank_device(device, rank)),
                threads=threads,
                linear_plan=linear_plan,
            )
            proc = subprocess.Popen(
                [sys.executable, "-m", "worker.parallel.follower"], stdin=subprocess.PIPE, env=env
            )
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(spec))
            proc.stdin.close()
            ranks._procs[rank] = proc
        atexit.register(ranks._at_exit)
        logger.info("tensor parallel: started ranks 1..%d (%d threads each)", size - 1, threads)
        return ranks

    def connect(self) -> None:
        """Wait for every rank to load its shard, then join the group (rank 0's shard must be
        loaded). Raises ``TensorParallelError`` with the reason where a rank failed."""
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        waiting = set(self._procs)
        while waiting:
            for rank in list(waiting):
                if self._store.check([f"error/{rank}"]):
                    reason = self._store.get(f"error/{rank}").decode()
                    self._kill_all()
                    raise TensorParallelError(f"rank {rank} failed to load its shard: {reason}")
                if self._procs[rank].poll() is not None:
                    self._kill_all()
                    raise TensorParallelError(
                        f"rank {rank} exited with code {self._procs[rank].returncode} "
                        "while loading its shard"
                    )
                if self._store.check([f"ready/{rank}"]):
                    waiting.discard(rank)
            if time.monotonic() > deadline:
                self._kill_all()
                raise TensorParallelError(f"ranks {sorted(waiting)} did not load in time")
            time.sleep(0.02)
        self.group.connect(self._store)
        for rank, proc in self._procs.items():
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"tp-rank-{rank}", daemon=True
            ).start()

    def on_failure(self, callback: Callable[[TensorParallelError], None]) -> None:
        """Call ``callback`` (from whichever thread notices) when the group fails; at once if
        it already has."""
        with self._lock:
            self._callbacks.append(callback)
            failure = self.failure
        if failure is not None:
            callback(failure)

    def check(self) -> None:
        """Raise the group's failure, if it failed."""
        if self.failure is not None:
            raise self.failure

    def fail(self, cause: BaseException) -> TensorParallelError:
        """Mark the group failed (the first cause wins), kill the other ranks, run the
        callbacks; returns the error to raise."""
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = (
                    cause
                    if isinstance(cause, TensorParallelError)
                    else TensorParallelError(f"the tensor-parallel group failed: {cause!r}")
                )
            failure = self.failure
            callbacks = list(self._callbacks) if first else []
        assert failure is not None
        if first:
            logger.error("tensor parallel: %s; stopping the other ranks", failure)
            self._kill_all()
            for callback in callbacks:
                callback(failure)
        return failure

    def shutdown(self) -> None:
        """Stop the other ranks and leave the group (rank 0's step loop must be idle)."""
        from worker.parallel import step_message

        if self._stopping:
            return
        self._stopping = True
        if self.failure is None and self.group.control is not None:
            try:
                step_message.send(self.group, None)
            except Exception:  # a rank died meanwhile: kill the rest below
                logger.exception("tensor parallel: could not tell the ranks to stop")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self._procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.group.close()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
        atexit.unregister(self._at_exit)

    def abandon(self) -> None:
        """Kill the other ranks at once (rank 0 failed to start) and leave the group."""
        self._at_exit()
        self.group.close()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
        atexit.unregister(self._at_exit)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._stopping:
            self.fail(TensorParallelError(f"rank {rank} exited with code {code}"))

    def _at_exit(self) -> None:
        self._stopping = True
        self._kill_all()

    def _kill_all(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
