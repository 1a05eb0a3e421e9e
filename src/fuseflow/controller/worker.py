"""The ``Worker`` base class and the ``@register`` decorator that names how a method is dispatched.

A role (actor, critic, reference, reward) is a ``Worker`` subclass. The controller never
calls a worker directly: it calls the role's ``WorkerGroup``, which reads the method's
registration to decide which ranks get which part of the input and how their outputs
are combined (HybridFlow's transfer protocols). Modes:

=============  =========================================  ==========================================
mode           dispatch (controller -> ranks)              default collect (ranks -> controller)
=============  =========================================  ==========================================
one_to_all     every rank gets the same arguments          ``list``: one result per rank
dp_split       first argument split by data-parallel rank  ``concat``: results put back in the
               (a ``Batch``: balanced by token count and   original order, padding rows removed
               padded to equal sizes; a list: contiguous)
rank_zero      rank 0 alone                                its result
all            argument ``i`` must be a list of one value  ``list``
               per rank; rank r gets element r
=============  =========================================  ==========================================

``collect`` overrides the default: ``list``, ``concat`` or ``rank_zero`` (e.g. a data-parallel
update whose metrics are all-reduced inside the workers returns rank 0's copy).

``split_args=n`` (``dp_split`` only) splits the first ``n`` arguments together, row for row,
by the plan of the first: for methods whose samples come as parallel lists, such as the
reward's ``score(prompts, responses)``.

Example::

    class Critic(Worker):
        @register("dp_split")
        def compute_values(self, batch: Batch) -> torch.Tensor: ...       # (B_rank, T) per rank

        @register("dp_split", collect="rank_zero")
        def update(self, batch: Batch, lr: float) -> dict[str, float]: ...

    values = critic_group.compute_values(batch)            # (B, T), in batch order
    pending = critic_group.compute_values.future(batch)    # returns at once; .result() waits
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

MODES = ("one_to_all", "dp_split", "rank_zero", "all")
COLLECTS = ("list", "concat", "rank_zero")
DEFAULT_COLLECT = {"one_to_all": "list", "dp_split": "concat", "rank_zero": "rank_zero", "all": "list"}
_ATTR = "__fuseflow_dispatch__"


@dataclass(frozen=True)
class Dispatch:
    """How one worker method is called on a group: ``mode`` in, ``collect`` out."""

    mode: str
    collect: str
    split_args: int = 1  # dp_split: leading arguments split together, row for row


def register(mode: str = "one_to_all", collect: str | None = None, split_args: int = 1) -> Callable:
    """Mark a ``Worker`` method as callable through a ``WorkerGroup`` (see the module docstring)."""
    if not isinstance(split_args, int) or split_args < 1:
        raise ValueError(f"register: split_args={split_args!r} must be an int >= 1 (leading arguments to split)")
    if split_args > 1 and mode != "dp_split":
        raise ValueError(f"register: split_args={split_args} splits arguments over ranks; it needs mode='dp_split', "
                         f"got mode={mode!r}")
    if mode not in MODES:
        raise ValueError(f"register: mode={mode!r} is not known; choose one of {', '.join(MODES)}")
    collect = collect or DEFAULT_COLLECT[mode]
    if collect not in COLLECTS:
        raise ValueError(f"register: collect={collect!r} is not known; choose one of {', '.join(COLLECTS)}")
    if collect == "concat" and mode != "dp_split":
        raise ValueError(f"register: collect='concat' restores a dp_split; mode={mode!r} has nothing to restore")

    def mark(fn: Callable) -> Callable:
        setattr(fn, _ATTR, Dispatch(mode, collect, split_args))
        return fn

    return mark


def dispatch_of(cls: type, name: str) -> Dispatch | None:
    """The registration of ``cls.name``, or None when it is not a registered worker method."""
    return getattr(getattr(cls, name, None), _ATTR, None)


def registered_methods(cls: type) -> dict[str, Dispatch]:
    """Every ``@register``-ed method of ``cls`` (inherited ones included): name -> its ``Dispatch``."""
    return {n: d for n in dir(cls) if (d := dispatch_of(cls, n)) is not None}


@dataclass(frozen=True)
class DistInfo:
    """Where one worker sits in its group.

    rank, world_size: the data-parallel rank and size of the role (``<role>.dp``)
    distributed:      True when a torch.distributed process group spans the role's ranks
                      (then every collective in the role's methods runs on it)
    device:           "cpu" or "cuda" (the worker's one visible GPU)
    """

    rank: int = 0
    world_size: int = 1
    distributed: bool = False
    device: str = "cpu"


class Worker:
    """Base of every role: knows its place in the group and reduces across it.

    Subclasses keep their own constructors; the host process calls ``attach`` once the
    worker is built. Collectives run only when ``dist.distributed`` is set, so the same
    code runs in-process (``local`` backend) with no process group at all.
    """

    role: str = "worker"
    dist: DistInfo = DistInfo()

    def attach(self, dist: DistInfo) -> None:
        """Record where this worker sits (``DistInfo``: rank, size, process group, device); the host calls it
        once, after the builder made the worker and before any method call."""
        self.dist = dist

    @property
    def rank(self) -> int:
        """This worker's data-parallel rank within its role (0 until ``attach``)."""
        return self.dist.rank

    @property
    def world_size(self) -> int:
        """The role's data-parallel size, ``<role>.dp`` (1 until ``attach``)."""
        return self.dist.world_size

    def all_reduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        """Sum scalar metrics over the group's ranks (identity on one rank).

        Keys are reduced in sorted order, so every rank must pass the same keys: a rank
        that has nothing to add for a key passes 0.0.
        """
        if not self.dist.distributed or self.dist.world_size == 1:
            return dict(values)
        import torch.distributed as dist

        keys = sorted(values)
        # NCCL reduces only GPU tensors; gloo only CPU ones.
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.dist.device)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist(), strict=True))

    def all_reduce_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """SUM of ``t`` over the group's ranks (identity on one rank), e.g. global token counts."""
        if not self.dist.distributed or self.dist.world_size == 1:
            return t
        import torch.distributed as dist

        out = t.detach().to(self.dist.device, copy=True)
        dist.all_reduce(out)
        return out.to(t.device)
