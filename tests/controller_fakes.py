"""Fake workers for the controller tests: small, deterministic methods, one per dispatch mode.

Kept in their own module so Ray worker processes can import them (the test fixture puts
this directory on their PYTHONPATH).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

from fuseflow.controller.group import Done, WorkerGroup
from fuseflow.controller.worker import DistInfo, Worker, register
from fuseflow.data.batch import Batch


class Echo(Worker):
    role = "echo"

    def __init__(self, scale: float = 1.0):
        self.scale, self.seen = scale, []

    @register("dp_split")
    def row_ids(self, batch: Batch) -> torch.Tensor:
        """(B_rank,) each row's id times ``scale``; remembers what this rank was sent."""
        self.seen.append((batch.meta["uid"], batch["response_mask"].sum(-1).tolist()))
        return batch["row"].float() * self.scale

    @register("dp_split")
    def first_items(self, items: list) -> list:
        return [(self.rank, x) for x in items]

    @register("dp_split")
    def as_batch(self, batch: Batch) -> Batch:
        return Batch({"double": batch["row"] * 2}, {"uid": batch.meta["uid"]})

    @register("one_to_all")
    def whoami(self, tag: str) -> tuple:
        return (tag, self.rank, self.world_size, os.getpid())

    @register("one_to_all")
    def niceness(self) -> int:
        return os.nice(0)

    @register("one_to_all")
    def sched_policy(self) -> int:
        """The scheduling policy of the thread that runs this call (Linux)."""
        return os.sched_getscheduler(0)

    @register("one_to_all")
    def thread_name(self) -> str:
        """The OS name of the thread that runs this call (Linux)."""
        return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    @register("rank_zero")
    def only_rank_zero(self) -> int:
        return self.rank

    @register("all")
    def per_rank(self, x: int, y: int = 0) -> int:
        return x * 10 + y

    @register("one_to_all")
    def history(self) -> list:
        return self.seen

    @register("dp_split", collect="rank_zero")
    def global_rows(self, batch: Batch) -> dict[str, float]:
        """Rows (with loss weight) over every rank: an all-reduce inside the worker."""
        return self.all_reduce_sum({"rows": float(batch["response_mask"].sum(-1).gt(0).sum())})

    @register("one_to_all")
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @register("one_to_all")
    def threads(self) -> int:
        return torch.get_num_threads()

    @register("one_to_all", collect="rank_zero")
    def stall_then_reduce(self, stall_rank: int, seconds: float) -> dict[str, float]:
        """Rank ``stall_rank`` sleeps while the others wait in an all-reduce (a collective that times out)."""
        if self.rank == stall_rank:
            time.sleep(seconds)
        return self.all_reduce_sum({"one": 1.0})

    @register("rank_zero")
    def fail(self, message: str) -> None:
        raise ValueError(message)

    def not_registered(self) -> None:
        """Plain methods are not callable through a group."""


def build_echo(dist: DistInfo, scale: float = 1.0) -> Echo:
    return Echo(scale)


def make_batch(n: int, lengths: list[int] | None = None) -> Batch:
    """``n`` rows; row ``i`` has ``lengths[i]`` real tokens (default 1 + i % 3) and id ``i``."""
    lengths = lengths or [1 + i % 3 for i in range(n)]
    width = max(lengths)
    attn = torch.tensor([[1] * k + [0] * (width - k) for k in lengths])  # (B, T)
    return Batch({"row": torch.arange(n), "attention_mask": attn, "response_mask": attn.float()},
                 {"uid": [f"u{i}" for i in range(n)]})


class InlineGroup(WorkerGroup):
    """k ranks of a role in this process, called one after another: dispatch logic without processes.

    Records the ranks of every call (``called``) and the row count of each rank's first argument
    (``sent``).
    """

    def __init__(self, workers):
        super().__init__(workers[0].role, type(workers[0]), len(workers))
        self.workers = workers
        for r, w in enumerate(workers):
            w.attach(DistInfo(r, len(workers)))
        self.called: list[list[int]] = []
        self.sent: list[list[int]] = []

    def _submit(self, name, ranks, per_rank, collect):
        self.called.append(list(ranks))
        self.sent.append([len(a[0]) if a and hasattr(a[0], "__len__") else 0 for a, _ in per_rank])
        outs = [getattr(self.workers[r], name)(*a, **kw) for r, (a, kw) in zip(ranks, per_rank, strict=True)]
        self._count([0.01] * len(ranks))
        return Done(collect(outs))
