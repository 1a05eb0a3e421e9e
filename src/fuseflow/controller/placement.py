"""Resource pools and placement: which worker processes each role runs in.

A pool is ``nodes x workers_per_node`` worker processes, each with ``cpus_per_worker``
CPU slots and ``gpus_per_worker`` GPUs. ``placement`` maps each role to a pool:

- roles on the same pool are colocated: rank r of each lives in the pool's r-th process
  (one process holds actor, reference and critic, as verl does);
- roles on different pools run side by side on their own processes (split placement),
  so e.g. the critic's update can overlap the actor's.

A role with ``dp=k`` occupies its pool's first k processes. Roles that train (actor,
critic) shard their model over the pool's process group, so their ``dp`` must equal the
pool's size. A pool named in ``placement`` but not in ``pools`` gets one node with as many
1-CPU workers as its largest ``dp`` (``placement.reward=reward reward.dp=2``: two reward
workers). Pure functions of the config, so ``fuseflow config`` validates a placement
without starting anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

TRAINABLE = ("actor", "critic")


@dataclass(frozen=True)
class PoolPlan:
    name: str
    nodes: int
    workers_per_node: int
    cpus_per_worker: float
    gpus_per_worker: float

    @property
    def size(self) -> int:
        """Worker processes in the pool, ``nodes * workers_per_node`` (its ranks 0 to size - 1)."""
        return self.nodes * self.workers_per_node


@dataclass(frozen=True)
class Placement:
    """Resolved pools (``name -> PoolPlan``), each role's pool and each role's ``dp``."""

    pools: dict[str, PoolPlan]
    role_pool: dict[str, str]
    dp: dict[str, int]

    def cpus_needed(self) -> float:
        """Ray CPU slots all pools together reserve (each pool's ``size * cpus_per_worker``); a local Ray started
        for the run gets at least this many."""
        return sum(p.size * p.cpus_per_worker for p in self.pools.values())

    def gpus_needed(self) -> float:
        """GPUs all pools together reserve (each pool's ``size * gpus_per_worker``, fractions allowed). A local
        Ray started for the run is given this many, rounded up; when it is 0, Ray detects the GPUs itself."""
        return sum(p.size * p.gpus_per_worker for p in self.pools.values())


def resolve_placement(pools: dict[str, Any], placement: dict[str, str], dp: dict[str, int]) -> Placement:
    """Check a placement and size its pools.

    ``pools`` maps a name to an object with ``nodes``, ``workers_per_node`` (None: sized by
    its roles), ``cpus_per_worker`` and ``gpus_per_worker``; ``placement`` maps role -> pool;
    ``dp`` maps role -> data-parallel size. Raises ValueError naming the config key to fix.

    >>> p = resolve_placement({}, {"actor": "main", "critic": "side"}, {"actor": 2, "critic": 2})
    >>> p.pools["main"].size, p.pools["side"].size
    (2, 2)
    """
    plans: dict[str, PoolPlan] = {}
    for name in dict.fromkeys(placement.values()):
        roles = [r for r, p in placement.items() if p == name]
        cfg = pools.get(name)
        nodes = getattr(cfg, "nodes", 1)
        wpn = getattr(cfg, "workers_per_node", None)
        if wpn is None:
            wpn = math.ceil(max(dp[r] for r in roles) / nodes)
        plans[name] = PoolPlan(name, nodes, wpn, float(getattr(cfg, "cpus_per_worker", 1.0)),
                               float(getattr(cfg, "gpus_per_worker", 0.0)))
    for role, name in placement.items():
        size, k = plans[name].size, dp[role]
        if k > size:
            raise ValueError(f"{role}.dp={k} does not fit pool {name!r} ({size} workers = nodes x workers_per_node); "
                             f"raise pools.{name}.workers_per_node or lower {role}.dp")
        if role in TRAINABLE and k != size:
            _blame_widest(pools, placement, dp, name, size, role)
            raise ValueError(f"{role}.dp={k} must equal the size of its pool {name!r} ({size} workers): a training "
                             f"role shards its model over the whole pool; set {role}.dp={size} or place {role} on a "
                             f"pool of its own (placement.{role}=NAME)")
    unused = sorted(set(pools) - set(plans))
    if unused:
        raise ValueError(f"pools.{unused[0]}: no role is placed on it; map a role to it (placement.ROLE={unused[0]}) "
                         "or remove it")
    return Placement(plans, dict(placement), dict(dp))


def _blame_widest(pools: dict[str, Any], placement: dict[str, str], dp: dict[str, int], name: str, size: int,
                  role: str) -> None:
    """Name the inference role (e.g. ``reward.dp=2``) that sized a pool past its training roles, if one did.

    Without this, raising ``reward.dp`` on the shared default pool reads as an ``actor.dp`` error.
    """
    if getattr(pools.get(name), "workers_per_node", None) is not None:
        return
    # The widest role sized the pool (rounded up to whole nodes); a training role is blamed as usual.
    on_pool = [r for r, p in placement.items() if p == name]
    wide = max(on_pool, key=dp.__getitem__)
    if wide in TRAINABLE or dp[wide] <= max(dp[r] for r in on_pool if r in TRAINABLE):
        return
    raise ValueError(f"{wide}.dp={dp[wide]} makes pool {name!r} {size} workers, but {role}.dp={dp[role]} must equal "
                     f"its pool's size (a training role shards its model over the whole pool); place {wide} on a "
                     f"pool of its own (placement.{wide}={wide}) or set {role}.dp={size}")
