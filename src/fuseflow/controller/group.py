"""``WorkerGroup``: one role's workers, called by the controller like a local object.

``group.compute_values(batch)`` splits the batch over the role's ranks, runs the method
on each and returns the outputs in batch order. ``group.compute_values.future(batch)``
returns at once with a ``Future`` so the controller can keep several groups busy; on the
in-process backend the call has already run when the future comes back.

Each group also counts the seconds its workers spent computing (the slowest rank of each
call), which is how a step's controller overhead is measured: step time minus the
compute of every group.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fuseflow.data.batch import Batch

from .dispatch import plan_for, restore, shard
from .worker import Dispatch, dispatch_of, registered_methods

_lane = threading.local()


@contextmanager
def beside() -> Iterator[None]:
    """Group calls started in this block (on this thread) run beside the worker processes' other calls.

    A worker process runs its roles' calls one at a time, in the order they come. A call started
    here takes a lane of its own instead (on Ray, the host's ``beside`` concurrency group), so two
    roles colocated in one process, such as PPO's actor and critic updates in a fused mode, compute
    at the same time on two cores. Never start a call beside another call of the same role: one
    model is not safe to use from two threads. In-process groups run calls on the caller's thread,
    so for them the block changes nothing.
    """
    with _marked("beside"):
        yield


@contextmanager
def _marked(lane: str) -> Iterator[None]:
    """This thread's calls carry the mark ``lane`` inside the block (restored after, so blocks nest)."""
    before = getattr(_lane, lane, False)
    setattr(_lane, lane, True)
    try:
        yield
    finally:
        setattr(_lane, lane, before)


def started_beside() -> bool:
    """Whether this thread is inside ``beside()``."""
    return getattr(_lane, "beside", False)


@contextmanager
def background() -> Iterator[None]:
    """Group calls started in this block (on this thread) run in the background of their worker processes.

    Such a call takes a lane of its own (on Ray, the host's ``background`` concurrency group,
    one thread) that runs under ``SCHED_IDLE`` (``controller.priority``): it computes only on a
    core that no other work wants. Streamed inference uses it while the rollout replicas decode
    on the same cores, and an async prefetch's inference while the updates train: the critical
    path keeps its cores and the inference fills the gaps (a replica done early, a wait on a
    transfer) and whatever follows. Like ``beside()``, never while the same role runs another
    call; in-process groups run calls on the caller's thread, so for them it changes nothing.
    """
    with _marked("background"):
        yield


def started_background() -> bool:
    """Whether this thread is inside ``background()``."""
    return getattr(_lane, "background", False)


class WorkerFailure(RuntimeError):
    """A worker died or raised (e.g. a collective timed out); names the role, rank and method.

    ``RLTrainer`` adds the last checkpointed step before it reaches the user.
    """

    def __init__(self, role: str, rank: int, method: str, cause: str, host: str = "", note: str = ""):
        self.role, self.rank, self.method, self.cause, self.host, self.note = role, rank, method, cause, host, note
        where = f" ({host})" if host else ""
        super().__init__(f"{role} worker rank {rank}{where} failed in {role}.{method}: {cause}"
                         + (f"; {note}" if note else ""))

    def __reduce__(self):  # picklable (Ray carries it out of a replica process): rebuilt from its fields
        return WorkerFailure, (self.role, self.rank, self.method, self.cause, self.host, self.note)

    def noted(self, note: str) -> WorkerFailure:
        """The same failure with ``note`` appended (e.g. the last checkpoint and how to resume)."""
        return WorkerFailure(self.role, self.rank, self.method, self.cause, self.host, note)


def first_line(e: BaseException) -> str:
    """The first non-empty line of an error's message (vLLM's can run to pages)."""
    return next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)


class Future:
    """The pending result of a group call; ``result()`` waits for it (raising ``WorkerFailure``).

    ``withdraw``, where a backend offers it (a one-rank Ray call in a lane of one thread): a call that
    takes the call back if it has not started yet (True: it will not compute, and ``result()`` is then
    ``host.Withdrawn``), else False.
    """

    withdraw: Callable[[], bool] | None = None

    def result(self) -> Any:
        """Block until every rank of the call has finished and return the result its ``collect`` rule put
        together; the first rank to fail raises (on Ray ``WorkerFailure``, or a task's ``RewardError`` or
        ``DataError`` as it is)."""
        raise NotImplementedError

    def done(self) -> bool:
        """Whether every rank of the call has finished (or failed), without waiting: ``result()`` then returns
        or raises at once."""
        raise NotImplementedError


class Done(Future):
    """A result that is already there (the in-process backend runs calls eagerly)."""

    def __init__(self, value: Any):
        self.value = value

    def result(self) -> Any:
        """The value of a call that already ran (e.g. eagerly in ``LocalGroup._submit``, or a pipeline's
        update); never blocks."""
        return self.value

    def done(self) -> bool:
        """Always True: the call ran before this future was made."""
        return True


class GroupMethod:
    """``group.name``: call it for the result, or ``.future(...)`` for a ``Future``."""

    def __init__(self, group: WorkerGroup, name: str, spec: Dispatch):
        self.group, self.name, self.spec = group, name, spec

    def __call__(self, *args, **kwargs) -> Any:
        return self.future(*args, **kwargs).result()

    def future(self, *args, **kwargs) -> Future:
        """Start the call on the group's ranks and return its ``Future`` without waiting for the result (the
        in-process backend runs it before returning, as a ``Done``)."""
        return self.group.call(self.name, self.spec, args, kwargs)

    def __repr__(self) -> str:
        return f"<{self.group.role}.{self.name} {self.spec.mode}->{self.spec.collect} over {self.group.world_size}>"


class WorkerGroup(ABC):
    """The ranks of one role. Subclasses run per-rank calls (``_submit``) in-process or on Ray."""

    def __init__(self, role: str, cls: type, world_size: int):
        self.role, self.cls, self.world_size = role, cls, world_size
        self.compute_seconds = 0.0  # summed over calls: the slowest rank's seconds of each
        self.compute_cpu_seconds = 0.0  # CPU seconds of every rank of every call (remote workers only)
        self.calls = 0

    def __getattr__(self, name: str) -> GroupMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        spec = dispatch_of(self.cls, name)
        if spec is None:
            known = ", ".join(sorted(registered_methods(self.cls))) or "none"
            raise AttributeError(f"{self.cls.__name__}.{name} is not a registered worker method (decorate it with "
                                 f"@register); the {self.role} group has: {known}")
        return GroupMethod(self, name, spec)

    def call(self, name: str, spec: Dispatch, args: tuple, kwargs: dict) -> Future:
        """Dispatch one call by ``spec.mode``; the returned future collects by ``spec.collect``."""
        k, plan = self.world_size, None
        if spec.mode == "rank_zero":
            ranks, per_rank = [0], [(args, kwargs)]
        elif spec.mode == "one_to_all":
            ranks, per_rank = list(range(k)), [(args, kwargs)] * k
        elif spec.mode == "all":
            for i, a in enumerate([*args, *kwargs.values()]):
                if not isinstance(a, (list, tuple)) or len(a) != k:
                    raise ValueError(f"{self.role}.{name} (mode 'all'): argument {i} must be a list with one "
                                     f"value per rank ({k}), got {type(a).__name__}")
            ranks = list(range(k))
            per_rank = [(tuple(a[r] for a in args), {n: v[r] for n, v in kwargs.items()}) for r in ranks]
        else:  # dp_split
            n = spec.split_args
            if len(args) < n:
                raise ValueError(f"{self.role}.{name} (mode 'dp_split') needs the data as its first "
                                 f"{'argument' if n == 1 else f'{n} positional arguments'}, got {len(args)}")
            if n > 1:  # checked at any k, so one worker fails the way several do
                _check_aligned(self.role, name, args[:n])
            ranks = list(range(k))
            if k == 1:
                per_rank = [(args, kwargs)]
            else:
                plan = plan_for(args[0], k)
                pieces = [shard(a, plan) for a in args[:n]]
                per_rank = [((*(p[r] for p in pieces), *args[n:]), kwargs) for r in ranks]
        return self._submit(name, ranks, per_rank, lambda results: self._collect(spec, results, plan))

    @staticmethod
    def _collect(spec: Dispatch, results: list, plan) -> Any:
        if spec.collect == "rank_zero":
            return results[0]
        if spec.collect == "list":
            return list(results)
        return results[0] if plan is None else restore(results, plan)

    @property
    def runs_beside(self) -> bool:
        """Whether this role's calls may run ``beside()`` another role's in the same processes: not when its
        ranks run collectives on their pool's process group (several ranks), which one process must
        not enter from two threads at once, nor in an order that differs between its processes."""
        return self.world_size == 1

    def lend_threads(self, cores: dict[str, int], at_once: int = 1) -> None:
        """Give each rank's process as many more intra-op threads as ``cores`` names for its Ray node
        (``{}``: back to its own), until told otherwise; ``at_once`` pools train at the same time and
        share those cores and the node's.

        For the cores of rollout replicas that sit idle while this role trains (sequential modes).
        In-process groups compute on the controller's threads, which the caller sets itself.
        """
        return None  # in-process: nothing to lend (RayGroup overrides it)

    def _count(self, seconds: list[float], cpu_seconds: float = 0.0) -> None:
        self.compute_seconds += max(seconds, default=0.0)
        self.compute_cpu_seconds += cpu_seconds
        self.calls += 1

    @abstractmethod
    def _submit(self, name: str, ranks: list[int], per_rank: list[tuple[tuple, dict]],
                collect: Callable[[list], Any]) -> Future:
        """Start ``name`` on ``ranks`` with their arguments; the future applies ``collect`` to the results."""


def _check_aligned(role: str, name: str, data: tuple) -> None:
    """Raise unless the arguments a ``dp_split`` cuts together are Batches or lists of one row per sample each."""
    for i, a in enumerate(data):
        if not isinstance(a, (Batch, list, tuple)):
            raise TypeError(f"{role}.{name} (mode 'dp_split'): argument {i} is split over the ranks and must be a "
                            f"Batch or a list, got {type(a).__name__}")
    lengths = [len(a) for a in data]
    if len(set(lengths)) > 1:
        raise ValueError(f"{role}.{name} (mode 'dp_split'): its first {len(data)} arguments are split together and "
                         f"need one row per sample each, got lengths {lengths}")


class LocalGroup(WorkerGroup):
    """One worker in this process: a call is a plain method call, no copies and no serialization."""

    def __init__(self, role: str, worker: Any):
        super().__init__(role, type(worker), 1)
        self.worker = worker

    def _submit(self, name, ranks, per_rank, collect) -> Future:
        (args, kwargs), = per_rank
        t0 = time.perf_counter()
        try:
            out = getattr(self.worker, name)(*args, **kwargs)
        finally:
            self._count([time.perf_counter() - t0])
        return Done(collect([out]))
