"""Build worker groups on the configured backend; the one entry point the trainer uses.

    cluster = make_cluster(cfg)                           # local: nothing starts; ray: pools start
    critic = cluster.group("critic", CriticWorker, partial(build_critic, ctx))
    values = critic.compute_values(batch)
    cluster.shutdown()

A builder is a picklable callable ``builder(dist: DistInfo) -> Worker`` that runs where the
worker lives (in this process for ``local``, in the pool's processes for ``ray``), so
models are loaded on the workers, never shipped from the controller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .group import LocalGroup, WorkerGroup
from .worker import DistInfo


class Cluster(Protocol):
    def group(self, role: str, cls: type, builder: Callable[[DistInfo], object],
              placed_as: str | None = None) -> WorkerGroup:
        """Build ``role`` with ``builder`` (called with each rank's ``DistInfo`` where that rank runs) and return
        the ``WorkerGroup`` that calls it; ``cls`` is the worker class whose registered methods the group offers,
        ``placed_as`` the placement entry to follow instead of ``role``'s own (safe_ppo's cost critic follows
        the critic's)."""

    def rollout_replicas(self, builder: Callable[[], object]):
        """The rollout replica processes (a ``ReplicaSet``; ``builder()`` makes each one's engine where it runs),
        or None when the rollout has no pool of its own (always None for ``local``)."""

    def shutdown(self) -> None:
        """Stop every worker process the cluster started and free what it reserved (nothing to stop for ``local``)."""


class LocalCluster:
    """Every role once, in this process: the embedded default, with no serialization on any call."""

    def group(self, role: str, cls: type, builder: Callable[[DistInfo], object],
              placed_as: str | None = None) -> LocalGroup:
        """Build ``role``'s one worker in this process (rank 0 of 1, no process group) and wrap it in a
        ``LocalGroup``; ``placed_as`` is ignored (nothing is placed). Raises TypeError when ``builder`` does not
        return a ``cls``."""
        info = DistInfo()
        worker = builder(info)
        if not isinstance(worker, cls):
            raise TypeError(f"builder for {role} made a {type(worker).__name__}, expected {cls.__name__}")
        if hasattr(worker, "attach"):
            worker.attach(info)
        return LocalGroup(role, worker)

    def rollout_replicas(self, builder: Callable[[], object]) -> None:
        """None: locally the pooled strategies run rollout workers on threads over the actor's model."""
        return None

    def shutdown(self) -> None:
        """Nothing to stop: the workers live in this process, and no process, port or placement group was started."""


def make_cluster(cfg, run_name: str | None = None) -> Cluster:
    """The cluster for ``cfg.backend``: ``LocalCluster`` or a started ``RayCluster``."""
    if cfg.backend == "local":
        return LocalCluster()
    from .ray_backend import RayCluster

    r = cfg.ray
    return RayCluster(cfg.resolved_placement(), r.start_timeout_s, r.collective_timeout_s, r.address, run_name)
