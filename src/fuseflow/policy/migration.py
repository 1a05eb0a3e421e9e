"""Long-tail migration policy (RLHFuse inter-stage fusion), as pure functions.

Once most samples of a step have finished generating, every rollout worker still runs a
few long samples and is mostly idle. Moving those few onto the fewest workers that can
hold them frees the rest for inference. This module only decides; the controller carries
the decision out with the engine's abort/resume.

Three questions, three functions:
- ``should_migrate``: has the step reached its tail (unfinished samples at or below the
  threshold, and would a move free at least one worker)?
- ``auto_threshold``: which threshold to use, chosen from earlier steps' response lengths
  with a small decode-cost model (``simulate_tail``).
- ``plan_migration``: onto which workers, and which samples move.

A sample's KV need is what it will hold when it finishes, ``kv_tokens + remaining``, so a
target worker never runs out of KV budget half-way through the tail.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Above this many workers the exact subset search gives way to a greedy order (C(20, 10) ~ 185k).
EXACT_SEARCH_MAX_WORKERS = 20
AUTO_CANDIDATES = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)
DEFAULT_THRESHOLD = 0.2


@dataclass(frozen=True)
class PendingSample:
    """One unfinished sample on a rollout worker.

    length:    tokens generated so far
    remaining: estimate of tokens still to generate (e.g. max_new_tokens - length, or a predictor's guess)
    kv_tokens: KV-cache tokens it holds now (prompt + generated)
    """

    uid: int
    length: int
    remaining: int
    kv_tokens: int

    @property
    def kv_need(self) -> int:
        """KV tokens it will hold when it finishes."""
        return self.kv_tokens + self.remaining


@dataclass(frozen=True)
class WorkerBudget:
    """Capacity of one rollout worker: sequence slots and KV-cache tokens."""

    slots: int
    kv_tokens: int

    def __post_init__(self) -> None:
        if self.slots < 1 or self.kv_tokens < 1:
            raise ValueError(f"WorkerBudget needs slots >= 1 and kv_tokens >= 1, got slots={self.slots}, "
                             f"kv_tokens={self.kv_tokens}")


@dataclass(frozen=True)
class Move:
    uid: int
    src: int
    dst: int


@dataclass(frozen=True)
class MigrationPlan:
    """Where the unfinished samples go.

    targets:  workers that keep generating (ascending ids)
    freed:    busy workers that stop generating and can start inference
    moves:    samples to abort on ``src`` and resume on ``dst``
    feasible: False when the samples fit on no set of fewer workers than now (then no move)
    """

    targets: tuple[int, ...]
    freed: tuple[int, ...]
    moves: tuple[Move, ...]
    feasible: bool
    reason: str = ""

    @property
    def moved_samples(self) -> int:
        """How many unfinished samples the plan aborts on one worker and resumes on another (one ``Move`` each)."""
        return len(self.moves)


def trigger_count(batch_size: int, threshold: float) -> int:
    """Unfinished samples at or below which the tail starts: ``floor(threshold * batch_size)``, at least 1."""
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"migration threshold must be a fraction in (0, 1), got {threshold}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return max(1, math.floor(threshold * batch_size + 1e-9))


def should_migrate(pending: Mapping[int, Sequence[PendingSample]], budgets: Mapping[int, WorkerBudget],
                   batch_size: int, threshold: float) -> bool:
    """True when the step is in its tail and the unfinished samples fit on fewer workers than hold them now."""
    unfinished = sum(len(v) for v in pending.values())
    if unfinished == 0 or unfinished > trigger_count(batch_size, threshold):
        return False
    plan = plan_migration(pending, budgets)
    return plan.feasible and bool(plan.freed)


def plan_migration(pending: Mapping[int, Sequence[PendingSample]],
                   budgets: Mapping[int, WorkerBudget]) -> MigrationPlan:
    """The fewest workers that can hold every unfinished sample, keeping the most work in place.

    Among the smallest feasible sets of target workers, the one that leaves the most samples
    where they are wins (ties: the most remaining tokens kept in place, then lower ids). Samples
    on a target worker stay; the others are placed first-fit-decreasing by KV need onto the
    target with the most free KV that still has a slot. Workers not in ``pending`` count as idle.

    >>> p = {0: [PendingSample(1, 10, 20, 30)], 1: [PendingSample(2, 5, 50, 25)]}
    >>> b = {0: WorkerBudget(4, 1000), 1: WorkerBudget(4, 1000)}
    >>> plan_migration(p, b).moves
    (Move(uid=1, src=0, dst=1),)
    """
    unknown = set(pending) - set(budgets)
    if unknown:
        raise ValueError(f"pending samples on workers {sorted(unknown)} that have no budget; "
                         f"budgets cover workers {sorted(budgets)}")
    busy = sorted(w for w, s in pending.items() if s)
    if not busy:
        return MigrationPlan((), (), (), True, "nothing unfinished")
    samples = [(w, s) for w in busy for s in pending[w]]
    workers = sorted(budgets)
    for m in range(1, len(busy)):
        for subset in _subsets_by_preference(workers, pending, m):
            moves = _place(samples, subset, budgets)
            if moves is not None:
                freed = tuple(w for w in busy if w not in subset)
                return MigrationPlan(tuple(sorted(subset)), freed, tuple(moves), True)
    return MigrationPlan(tuple(busy), (), (), False,
                         f"{len(samples)} unfinished samples fit on no set of fewer than {len(busy)} workers")


def _subsets_by_preference(workers: list[int], pending: Mapping[int, Sequence[PendingSample]], m: int):
    """Subsets of ``m`` workers, best first: most samples kept in place, then most remaining work kept."""
    def kept(w: int) -> tuple[int, int]:
        s = pending.get(w, ())
        return len(s), sum(x.remaining for x in s)

    if len(workers) > EXACT_SEARCH_MAX_WORKERS:  # greedy: the m workers with the most work in place
        order = sorted(workers, key=lambda w: (-kept(w)[0], -kept(w)[1], w))
        yield tuple(order[:m])
        return
    combos = itertools.combinations(workers, m)
    score = {c: tuple(map(sum, zip(*(kept(w) for w in c), strict=True))) for c in combos}
    yield from sorted(score, key=lambda c: (-score[c][0], -score[c][1], c))


def _place(samples: list[tuple[int, PendingSample]], subset: tuple[int, ...],
           budgets: Mapping[int, WorkerBudget]) -> list[Move] | None:
    """Moves that fit every sample onto ``subset`` (stayers first), or None when they do not fit."""
    slots = {w: budgets[w].slots for w in subset}
    kv = {w: budgets[w].kv_tokens for w in subset}
    movers = []
    for w, s in samples:
        if w in slots:
            slots[w] -= 1
            kv[w] -= s.kv_need
        else:
            movers.append((w, s))
    if any(v < 0 for v in slots.values()) or any(v < 0 for v in kv.values()):
        return None
    moves = []
    # Largest first, each onto the target with the most KV left: a standard bin-packing heuristic.
    for w, s in sorted(movers, key=lambda x: (-x[1].kv_need, x[1].uid)):
        fits = [d for d in subset if slots[d] > 0 and kv[d] >= s.kv_need]
        if not fits:
            return None
        dst = max(fits, key=lambda d: (kv[d], -d))
        slots[dst] -= 1
        kv[dst] -= s.kv_need
        moves.append(Move(s.uid, w, dst))
    return sorted(moves, key=lambda mv: mv.uid)


# ----------------------------------------------------------------------------- auto threshold
@dataclass(frozen=True)
class TailOutcome:
    """What migrating at one threshold would have done to one step (times in decode-step units).

    freed_worker_time: generation time the freed workers no longer spend (their finish time
    without migration, less the migration time), i.e. time they gain for inference.
    """

    workers: int
    makespan: float  # generation end without migration
    makespan_migrated: float  # generation end with migration
    freed_worker_time: float
    moved: int  # samples moved

    @property
    def gain(self) -> float:
        """Freed worker-time, less the later generation end, which every worker waits for (training)."""
        return self.freed_worker_time - self.workers * max(0.0, self.makespan_migrated - self.makespan)


def simulate_tail(lengths: Sequence[int], num_workers: int, slots: int, threshold: float,
                  per_sample_cost: float = 0.0, resume_cost: float = 1.0) -> TailOutcome:
    """Replays one step's generation with and without migration under a simple decode-cost model.

    Samples are dealt round-robin to ``num_workers`` workers and all start at time 0. A decode
    step of a worker with ``b`` live samples takes ``1 + per_sample_cost * b`` (0: memory-bound,
    as on a GPU; CPUs sit nearer 1 / slots). The tail starts after the decode step at which at
    most ``trigger_count`` samples are left, once every worker has reached it; the unfinished
    samples are then packed onto the ``ceil(unfinished / slots)`` workers holding most of them,
    each moved sample costing its new worker ``resume_cost`` steps (the prefill recompute).
    """
    if num_workers < 1 or slots < 1:
        raise ValueError(f"num_workers and slots must be >= 1, got {num_workers}, {slots}")
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError("lengths must be a non-empty list of response lengths >= 1")
    per_worker = [list(lengths[w::num_workers]) for w in range(num_workers)]

    def run(queue: list[int], start_step: int, t0: float) -> float:
        # Time at which a worker holding samples of these lengths is done, starting at decode step start_step.
        t = t0
        for k in range(start_step, max(queue, default=start_step)):
            t += 1.0 + per_sample_cost * sum(1 for n in queue if n > k)
        return t

    finish = [run(q, 0, 0.0) for q in per_worker]
    makespan = max(finish)
    trigger = trigger_count(len(lengths), threshold)
    srt = sorted(lengths)
    k_star = 0 if len(srt) <= trigger else srt[len(srt) - trigger - 1]  # steps until <= trigger are left
    live = [[n for n in q if n > k_star] for q in per_worker]
    busy = [w for w in range(num_workers) if live[w]]
    need = math.ceil(sum(map(len, live)) / slots)
    if need >= len(busy):
        return TailOutcome(num_workers, makespan, makespan, 0.0, 0)
    t_star = max(run([min(n, k_star) for n in q], 0, 0.0) for q in per_worker)
    kept = sorted(busy, key=lambda w: (-len(live[w]), w))[:need]
    queues = {w: list(live[w]) for w in kept}
    extra = dict.fromkeys(kept, 0)
    movers = sorted((n for w in busy if w not in queues for n in live[w]), reverse=True)
    for n in movers:  # longest first onto the emptiest kept worker
        dst = min(kept, key=lambda w: (len(queues[w]), w))
        queues[dst].append(n)
        extra[dst] += 1
    end = max(run(q, k_star, t_star + resume_cost * extra[w]) for w, q in queues.items())
    freed = sum(max(0.0, finish[w] - t_star) for w in busy if w not in queues)
    return TailOutcome(num_workers, makespan, end, freed, len(movers))


def auto_threshold(history: Sequence[Sequence[int]], num_workers: int, slots: int,
                   per_sample_cost: float = 0.0, resume_cost: float = 1.0,
                   candidates: Sequence[float] = AUTO_CANDIDATES, default: float = DEFAULT_THRESHOLD) -> float:
    """The candidate threshold with the largest mean ``gain`` over previous steps' response lengths.

    ``history`` holds one list of response lengths per earlier step (the most recent few are
    enough). Ties go to the smaller threshold, which moves fewer samples. With no history, or
    when no candidate gains anything, ``default`` is returned.
    """
    steps = [list(h) for h in history if h]
    if not steps:
        return default
    best, best_gain = default, 0.0
    for c in sorted(candidates):
        gain = sum(simulate_tail(h, num_workers, slots, c, per_sample_cost, resume_cost).gain
                   for h in steps) / len(steps)
        if gain > best_gain + 1e-12:
            best, best_gain = c, gain
    return best


def resolve_threshold(setting: float | str, history: Sequence[Sequence[int]], num_workers: int, slots: int,
                      **cost) -> float:
    """``schedule.migration_threshold``: a fraction in (0, 1), or ``"auto"`` (see ``auto_threshold``)."""
    if setting == "auto":
        return auto_threshold(history, num_workers, slots, **cost)
    if isinstance(setting, str):
        raise ValueError(f"migration threshold must be a fraction in (0, 1) or 'auto', got {setting!r}")
    trigger_count(1, float(setting))  # validates the range
    return float(setting)
