"""How a pooled strategy runs a step's updates: one after the other on every idle core, or side by side.

``Pooled.train`` (``fuseflow.schedule.modes``) hands the step's updates here (name -> starter of a
group call). Fused and async modes with several updates (PPO's actor and critic) run every update
but the last (the actor's) on a thread of its own and the last on the controller thread: the models
never touch each other's parameters and the mini-batch shuffles are seeded per update, so results
equal the one-after-another order. On Ray those threads start their calls ``beside()``, so roles
colocated in one process train at the same time there too; roles on several ranks (collectives on
their pool's group) are started in one order instead, as in ``sequential``. ``sequential`` and
``elastic`` keep that order (verl's), with each update on the cores of all rollout workers (they are
idle then: this process's threads, or lent to the roles' processes on Ray), as does ``fused`` with a
single update (GRPO); ``async`` with a single update trains on one core alone, beside the next step's
generation. Measured on the fusion benchmark (docs/benchmarks.md): async PPO with its updates side
by side 121-125 samples/s, one after the other on one thread 90-92.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from typing import Any

import torch

from fuseflow.controller.group import Future as GroupFuture
from fuseflow.controller.group import WorkerGroup, beside

from .base import update_threads
from .stages import overlap

ACTOR = "actor_update"  # the trainer's name for the actor's update (``RLTrainer.update_calls`` lists it last)


class Gate:
    """Opens once a step's updates have all ended; ``ok``: every one succeeded. ``on_open(fn)`` calls
    ``fn()`` when it opens (at once if it is open)."""

    def __init__(self):
        self._lock, self._open, self.ok = threading.Lock(), threading.Event(), False
        self._callbacks: list[Callable[[], None]] = []

    def open(self, ok: bool) -> None:
        """Open the gate with ``ok`` (whether every update succeeded): wake threads in ``wait`` and run the
        callbacks ``on_open`` registered, on this thread and outside the lock."""
        with self._lock:
            self.ok = ok
            self._open.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def is_open(self) -> bool:
        """Whether ``open`` was called (the step's updates have all ended), without waiting."""
        return self._open.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the gate opens or ``timeout`` seconds pass (None: no limit); True when it is open."""
        return self._open.wait(timeout)

    def on_open(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the gate opens, on the thread that opens it; at once, on this thread, if it is
        already open."""
        with self._lock:
            if not self._open.is_set():
                self._callbacks.append(fn)
                return
        fn()


class Updates:
    """A pooled strategy's update runner.

    ``trainers``: the groups that train (actor, critics); ``pool``: the rollout pool (its size and the
    cores it lends); ``first_track``: the trace track of the first side thread; ``side_by_side``: the
    mode may train several models at once (fused, async); ``beside_generation``: a single update
    trains beside the next step's generation (async), so it takes no lent cores.
    """

    def __init__(self, tracer, trainers: list[WorkerGroup], pool, first_track: int, side_by_side: bool,
                 beside_generation: bool):
        self.tracer, self.trainers, self.pool = tracer, trainers, pool
        self.first_track, self.side_by_side, self.beside_generation = first_track, side_by_side, beside_generation
        self.tracks: dict[str, int] = {}  # update name -> trace track of the thread that runs it

    def run(self, step: int, updates: dict[str, Callable[[], GroupFuture]],
            actor_trained: Callable[[Gate], None] | None = None) -> dict[str, Any]:
        """Run the step's updates; their results by name (a failed update's error is raised).

        ``actor_trained(gate)`` runs on this thread once the actor's update has returned: side by side
        (the actor's last, ``ACTOR``) while the others may still train, else once all have ended;
        ``gate`` opens when all have ended (``ok``: every one succeeded). Not called after a failure
        that is known by then.
        """
        # Roles on several Ray ranks run collectives on their pool's process group: their updates go out
        # in one order from this thread, so every process runs them in the same order (``overlap``).
        side_by_side = self.side_by_side and len(updates) > 1 and all(g.runs_beside for g in self.trainers)
        if not side_by_side:
            out = (overlap(self.tracer, step, updates) if self.beside_generation  # one core trains, the others
                   else self._in_order(step, updates))                          # generate the next step
            if actor_trained is not None:  # every update has ended: an open gate, so the next step's
                gate = Gate()               # generation leaves the background as soon as it starts
                gate.open(True)
                actor_trained(gate)
            return out
        names = list(updates)
        results: dict[str, Future] = {name: Future() for name in names}
        threads = []
        for name in names[:-1]:
            if name not in self.tracks:  # a thread's track is named once, when first used
                self.tracks[name] = self.first_track + len(self.tracks)
                self.tracer.name_track(self.tracks[name], f"training-{name.removesuffix('_update')}")
            threads.append(threading.Thread(target=self._one, args=(step, name, updates[name], self.tracks[name],
                                                                    results[name], True), daemon=True,
                                            name=f"train-{name}"))
        for th in threads:
            th.start()
        gate, early = Gate(), actor_trained is not None and names[-1] == ACTOR
        try:
            self._one(step, names[-1], updates[names[-1]], 0, results[names[-1]])
            if early and results[ACTOR].exception() is None:
                actor_trained(gate)
        finally:
            for th in threads:
                th.join()
            gate.open(all(results[name].done() and results[name].exception() is None for name in names))
        if actor_trained is not None and not early and gate.ok:
            actor_trained(gate)
        return {name: results[name].result() for name in names}

    def _in_order(self, step: int, updates: dict[str, Callable[[], GroupFuture]]) -> dict[str, Any]:
        """Nothing else runs now: each update gets the idle rollout workers' cores as intra-op threads
        (verl trains each model on all devices, one model after the other). Groups on different pools
        train at once (``overlap``), so they share those cores instead of each taking them all."""
        own = torch.get_num_threads()
        torch.set_num_threads(update_threads(own, len(self.pool)))
        lent, at_once = self.pool.lendable_cores(), len({getattr(g, "pool", None) for g in self.trainers})
        for g in self.trainers:
            g.lend_threads(lent, at_once)
        try:
            out = overlap(self.tracer, step, updates)
        finally:
            torch.set_num_threads(own)
        for g in self.trainers:  # not after a failed update: its error, not this call's, reaches the user
            g.lend_threads({})
        return out

    def _one(self, step: int, name: str, start: Callable[[], GroupFuture], track: int, out: Future,
             side: bool = False) -> None:
        with self.tracer.span(name, step, track=track):
            try:
                with beside() if side else nullcontext():
                    future = start()
                out.set_result(future.result())
            except BaseException as e:  # noqa: BLE001 - handed to the controller thread, which re-raises it
                out.set_exception(e)
