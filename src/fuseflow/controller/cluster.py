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
              placed_as: str | None = None) -> WorkerGroup: ...

    def rollout_replicas(self, builder: Callable[[], object]): ...

    def shutdown(self) -> None: ...


class LocalCluster:
    """Every role once, in this process: the embedded default, with no serialization on any call."""

    def group(self, role: str, cls: type, builder: Callable[[DistInfo], object],
              placed_as: str | None = None) -> LocalGroup:
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
        pass


def make_cluster(cfg, run_name: str | None = None) -> Cluster:
    """The cluster for ``cfg.backend``: ``LocalCluster`` or a started ``RayCluster``."""
    if cfg.backend == "local":
        return LocalCluster()
    from .ray_backend import RayCluster

    r = cfg.ray
    return RayCluster(cfg.resolved_placement(), r.start_timeout_s, r.collective_timeout_s, r.address, run_name)
