"""``WorkerHost``: the object inside one worker process (a Ray actor), holding its roles.

Roles placed on the same pool share these processes: rank ``r`` of the pool holds rank
``r`` of the actor, of the reference and of the critic, as verl's colocated workers do,
so one process keeps their models side by side and they never cross a process boundary.

The pool's processes form one torch.distributed process group (gloo on CPU, NCCL on
GPU) that every data-parallel role on the pool uses, set up with a free port picked at
run time and a timeout, which also bounds every collective: a peer that is gone turns
into an error here instead of a hang.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .dispatch import from_wire, to_wire
from .priority import name_thread, set_background
from .worker import DistInfo, Worker


class Withdrawn:
    """What a call returns that the controller took back (``WorkerHost.withdraw``) before it started."""


class WorkerHost:
    """Rank ``rank`` of pool ``pool`` (``world_size`` processes); builds and calls role workers.

    Calls on the serial and background lanes may carry a *ticket* (the controller numbers them in the
    order it submits them): ``withdraw(ticket, lane)`` takes such a call back while it still waits in
    its lane, and the call then returns ``Withdrawn`` without computing. The controller moves a log-prob
    call that way from the roles' busy background lane onto a rollout replica that came free.
    """

    def __init__(self, pool: str, rank: int, world_size: int, threads: int = 1):
        self.pool, self.rank, self.world_size = pool, rank, world_size
        self.threads = max(1, threads)  # the bundle's CPUs
        torch.set_num_threads(self.threads)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda":  # Ray makes exactly this worker's GPU visible, as device 0
            torch.cuda.set_device(0)
        self.distributed = False
        self.roles: dict[str, Worker] = {}
        self._tickets = threading.Lock()
        self._started: dict[str, int] = {}  # lane -> the highest ticket that started on it
        self._withdrawn: set[int] = set()

    def ready(self) -> int:
        """This process's pid, answered once the host is constructed: the controller waits for it (within
        ``ray.start_timeout_s``) to know the pool started, and keeps the pids."""
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free right now (rank 0 serves the process-group rendezvous)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_process_group(self, addr: str, port: int, timeout_s: float) -> None:
        """Join the pool's torch.distributed group (NCCL on GPU, gloo on CPU) as rank ``self.rank``, meeting at rank
        0's ``addr:port`` over TCP; ``timeout_s`` (seconds) bounds the rendezvous and every later collective, so a
        lost peer raises instead of hanging."""
        import torch.distributed as dist

        dist.init_process_group("nccl" if self.device == "cuda" else "gloo", init_method=f"tcp://{addr}:{port}",
                                rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.distributed = True

    def add_role(self, role: str, builder: Callable[[DistInfo], Worker], dp: int) -> None:
        """Build ``role``'s rank-``self.rank`` worker (the pool's first ``dp`` ranks hold the role)."""
        # Collectives run on the pool's group, so only a role spanning the whole pool may use them.
        info = DistInfo(self.rank, dp, self.distributed and 1 < dp == self.world_size, self.device)
        worker = builder(info)
        worker.attach(info)
        self.roles[role] = worker

    def call(self, role: str, method: str, args: tuple, kwargs: dict, ticket: int | None = None,
             lane: str = "serial") -> tuple[Any, float, float]:
        """Run ``role.method`` on this rank: (result as numpy-backed wire data, wall seconds, CPU seconds);
        ``(Withdrawn(), 0, 0)`` when its ``ticket`` was withdrawn before it started. While it runs, its thread
        has the OS name ``lane-LANE`` (``serial``, ``beside`` or ``background``), so per-thread tools tell the
        lanes apart; Ray names its task threads ``ray::IDLE`` again between tasks."""
        name_thread(f"lane-{lane}")
        if ticket is not None:
            with self._tickets:
                if ticket in self._withdrawn:
                    self._withdrawn.discard(ticket)
                    return Withdrawn(), 0.0, 0.0
                self._started[lane] = max(ticket, self._started.get(lane, -1))
        args, kwargs = from_wire(args), from_wire(kwargs)
        t0, c0 = time.perf_counter(), time.process_time()
        out = getattr(self.roles[role], method)(*args, **kwargs)
        return to_wire(out), time.perf_counter() - t0, time.process_time() - c0

    def withdraw(self, ticket: int, lane: str) -> bool:
        """Take back the call with ``ticket`` on ``lane`` if it has not started: True, and it will return
        ``Withdrawn`` without computing; False when it started (or finished).

        Why a ticket above every started one has not started: the check and the mark happen under
        one lock, whatever order the lane's calls arrive in.
        """
        with self._tickets:
            if ticket <= self._started.get(lane, -1):
                return False
            self._withdrawn.add(ticket)
            return True

    def call_background(self, role: str, method: str, args: tuple, kwargs: dict,
                        ticket: int | None = None) -> tuple[Any, float, float]:
        """``call`` under ``SCHED_IDLE``: only ever sent to the ``background`` lane, whose one thread keeps
        that priority for the process's life (leaving it may need a privilege); see ``group.background``."""
        set_background(threading.get_native_id(), True)
        return self.call(role, method, args, kwargs, ticket, "background")

    def lend_threads(self, cores: dict[str, int], at_once: int = 1) -> int:
        """Compute on the bundle's threads plus a share of ``cores[this node]`` (``{}``: just the bundle's):
        with ``at_once`` pools training at the same time, a 1/at_once share of those cores and never
        more than that share of the cores this process may run on (nor fewer than the bundle's threads);
        returns that thread count.

        The controller lends the cores of rollout replicas on this node while they sit idle to the
        serial lane (this call's thread: a sequential mode's updates). Ray counts CPU slots for
        placement and does not pin threads, and a fractional slot still computes on one thread: the
        cap on the process's cores is what keeps pools from oversubscribing them. Sequential PPO with
        the critic on a pool of its own, each pool taking both lent cores of a 2-core machine, took
        4.6-10.8 s a step; lending them nothing there, 1.3-1.7 s.
        """
        import ray

        at_once = max(1, at_once)
        extra = max(0, cores.get(ray.get_runtime_context().get_node_id(), 0)) // at_once
        have = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n = max(1, min(self.threads + extra, max(have // at_once, self.threads)))
        torch.set_num_threads(n)
        return torch.get_num_threads()

    def shutdown(self) -> None:
        """Destroy the pool's process group if this host joined one; a no-op otherwise (safe to call twice)."""
        if self.distributed:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.distributed = False
