"""Execution policies of the simulator and the decision rules they use.

A policy is a set of flags, written joined by '+':
- sequential (no flags): verl's order; each stage starts when the previous one has
  finished for the whole batch.
- fused: RLHFuse. Inter-stage: each sample goes to inference as soon as it finishes;
  once at most `migrate_frac` of the samples are left, they are packed onto fewer
  rollout replicas and the freed devices run inference. Intra-stage: actor and critic
  training on the same devices fill each other's pipeline bubbles.
- async: one-step off-policy; generation of step k+1 overlaps training of step k.
- elastic: RLHFless. Rollout workers are serverless: their count is chosen per step
  by a cost-aware rule on predicted lengths, prompts are assigned by predicted length,
  shared prompt prefixes are prefilled once, and cost is billed per busy GPU-second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fuseflow.policy.elastic import ReplicaOption, cheapest_within

from .costmodel import DecodeModel, broadcast_seconds
from .generation import Seq, kv_capacity_seqs, simulate_generation, sorted_chunks
from .hardware import HardwareSpec
from .modelspec import ModelSpec
from .placement import gen_layouts

FLAGS = ("fused", "async", "elastic")
# Migration thresholds RLHFuse-style fusion tries (fraction of the batch still generating;
# 0 = stream samples but never migrate). RLHFuse picks its threshold per workload by
# profiling; we pick it by simulation.
MIGRATE_GRID = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)


@dataclass(frozen=True)
class Policy:
    """Flags plus their knobs. `migrate_frac=None` searches MIGRATE_GRID.

    slowdown_budget: elastic picks the cheapest workers whose predicted step time is
    within (1 + budget) of the step time with the fastest workers.
    staleness: how many steps generation may run ahead of training under async.
    """

    fused: bool = False
    async_: bool = False
    elastic: bool = False
    migrate_frac: float | None = None
    slowdown_budget: float = 0.1
    staleness: int = 1

    @property
    def name(self) -> str:
        """Canonical name: the flags that are on, joined by '+' in the order fused, async, elastic, or
        'sequential'; `parse_policy` reads it back. The knobs are not part of it."""
        flags = [f for f, on in (("fused", self.fused), ("async", self.async_), ("elastic", self.elastic)) if on]
        return "+".join(flags) or "sequential"


POLICY_NAMES = ("sequential", "fused", "async", "elastic", "fused+async", "elastic+fused")


def parse_policy(name: str) -> Policy:
    """'sequential', or flags joined by '+', e.g. 'fused+async'."""
    if name == "sequential":
        return Policy()
    flags = name.split("+")
    bad = [f for f in flags if f not in FLAGS]
    if bad or not flags:
        raise ValueError(f"policy {name!r}: unknown flag(s) {bad}; use sequential or a '+' join of {', '.join(FLAGS)}")
    return Policy(fused="fused" in flags, async_="async" in flags, elastic="elastic" in flags)


@dataclass
class ElasticChoice:
    """The rollout workers chosen for one step and their predicted time and cost."""

    decode: DecodeModel
    cap: int
    startup: float
    workers: int
    predicted_makespan: float
    predicted_gpu_seconds: float
    assignment: list[list[Seq]]


def choose_workers(
    actor: ModelSpec, hw: HardwareSpec, seqs: list[Seq], predicted: np.ndarray, gpus: int, prompt_max: float,
    max_len: int, train_gpus: int, budget: float, rest: float = 0.0, keys: np.ndarray | None = None,
) -> ElasticChoice:  # fmt: skip
    """RLHFless's cost-aware choice of rollout workers, from predicted lengths.

    For each worker shape (TP x PP that holds the weights) and count w, replay the
    step on the predicted lengths with length-aware assignment and prefix sharing:
    predicted makespan T and GPU-seconds C = sum over workers of (startup + busy) x
    devices, where startup loads the new weights over the network. The budget is on
    the whole step: with `rest` the predicted seconds of the step outside the rollout,
    choose the least C among options with T + rest <= (1 + budget) x (T_fastest + rest).
    Sequences are assigned by `keys` (default: `predicted`), e.g. a group's mean
    prediction, while the replay runs on `predicted` itself.
    """
    keys = predicted if keys is None else keys
    options = []
    guess = [Seq(s.id, s.prompt, max(1, int(p)), s.group) for s, p in zip(seqs, predicted, strict=True)]
    for tg, pg in gen_layouts(actor, hw, gpus):
        dm = DecodeModel(actor, hw, tg, pg)
        cap = kv_capacity_seqs(dm, hw.usable_memory - dm.weight_bytes_per_gpu(), prompt_max, max_len)
        if cap < 1:
            continue
        startup = broadcast_seconds(actor, hw, dm.gpus, 1, train_gpus)
        for w in _worker_counts(gpus // dm.gpus):
            runs = simulate_generation(dm, sorted_chunks([_fresh(g) for g in guess], keys, w), cap,
                                       share_prefix=True)  # fmt: skip
            ends = [r.end for r in runs if r.finishes]
            options.append(ReplicaOption(w, startup + max(ends), sum(startup + e for e in ends) * dm.gpus,
                                         (dm, cap, startup)))
    if not options:
        raise ValueError(f"elastic: {actor.name} does not fit on one {hw.name} worker of up to {gpus} devices")
    best = cheapest_within(options, budget, rest)  # the runtime's rule (policy.elastic)
    dm, cap, startup = best.detail
    return ElasticChoice(dm, cap, startup, best.replicas, best.seconds, best.cost, sorted_chunks(seqs, keys, best.replicas))


def _fresh(s: Seq) -> Seq:
    return Seq(s.id, s.prompt, s.target, s.group)


def _worker_counts(max_workers: int) -> list[int]:
    """Every count up to 16, then a geometric grid (the rule's cost curve is smooth)."""
    if max_workers <= 16:
        return list(range(1, max_workers + 1))
    out = set(range(1, 17))
    x = 16.0
    while x < max_workers:
        x *= 1.25
        out.add(min(max_workers, int(math.ceil(x))))
    return sorted(out)
