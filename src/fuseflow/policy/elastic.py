"""The cost-aware choice of how many rollout replicas a step uses (RLHFless).

Each candidate count has a predicted makespan (when its last replica finishes) and a predicted
cost (worker-seconds: the sum over replicas of the time each is held). ``cheapest_within`` takes
the cheapest count whose whole step stays within a slowdown budget of the fastest count's. The
runtime prices candidates with ``replica_seconds`` under a decode-step cost fitted to what its
engines measured (``fit_decode_cost``); the simulator prices them with its cost model. Both then
decide with the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaOption:
    """One candidate: ``replicas`` workers finishing after ``seconds`` and billed ``cost`` worker-seconds."""

    replicas: int
    seconds: float
    cost: float
    detail: object = None  # whatever the caller needs to carry out the choice (e.g. an assignment)


def cheapest_within(options: Sequence[ReplicaOption], slowdown_budget: float, rest: float = 0.0) -> ReplicaOption:
    """The cheapest option whose step is at most ``(1 + slowdown_budget)`` times the fastest option's.

    ``rest`` is the predicted seconds of the step outside the rollout (inference, training), so
    the budget is on the whole step: ``seconds + rest <= (1 + budget) * (fastest + rest)``. Ties
    go to the faster option, then the fewer replicas.

    >>> opts = [ReplicaOption(1, 10.0, 10.0), ReplicaOption(2, 6.0, 12.0), ReplicaOption(4, 5.0, 20.0)]
    >>> cheapest_within(opts, 0.1).replicas, cheapest_within(opts, 0.1, rest=20.0).replicas
    (4, 2)
    """
    if not options:
        raise ValueError("elastic: no replica count to choose from")
    if slowdown_budget < 0:
        raise ValueError(f"elastic slowdown budget must be >= 0, got {slowdown_budget}")
    fastest = min(o.seconds for o in options)
    limit = (1.0 + slowdown_budget) * (fastest + rest) - rest
    return min((o for o in options if o.seconds <= limit * (1 + 1e-12)), key=lambda o: (o.cost, o.seconds, o.replicas))


@dataclass(frozen=True)
class DecodeCost:
    """Seconds of one engine step with ``rows`` live sequences: ``base + per_row * rows``."""

    base: float
    per_row: float

    def step_seconds(self, rows: int) -> float:
        """Predicted seconds of one engine step with ``rows`` live sequences: ``base + per_row * rows``."""
        return self.base + self.per_row * rows


def fit_decode_cost(rows: Sequence[int], seconds: Sequence[float], prior: DecodeCost) -> DecodeCost:
    """Least-squares ``base + per_row * rows`` over measured engine steps, both terms kept >= 0.

    With fewer than two distinct row counts the slope cannot be told from the intercept, so
    ``prior``'s ratio is kept and only the scale is fitted.

    >>> fit_decode_cost([1, 2, 3], [3.0, 5.0, 7.0], DecodeCost(1.0, 0.0))
    DecodeCost(base=1.0, per_row=2.0)
    """
    if len(rows) != len(seconds):
        raise ValueError(f"{len(rows)} row counts for {len(seconds)} timings")
    if not rows:
        return prior
    n = len(rows)
    mx, my = sum(rows) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in rows)
    if sxx > 0:
        b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(rows, seconds, strict=True)) / sxx)
        a = max(0.0, my - b * mx)
        if a > 0 or b > 0:
            return DecodeCost(a, b)
    scale = my / max(prior.step_seconds(round(mx)), 1e-12)
    return DecodeCost(prior.base * scale, prior.per_row * scale)


def replica_seconds(lengths: Sequence[float], slots: int, cost: DecodeCost) -> float:
    """Predicted decode seconds of one replica running sequences of these lengths, ``slots`` at a time.

    Sequences are admitted longest first as slots free up (what continuous batching does with a
    length-sorted queue) and every live sequence decodes one token per engine step.

    >>> replica_seconds([3, 1], 4, DecodeCost(1.0, 1.0))  # steps with 2, 1, 1 live rows
    7.0
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    ends = sorted((max(1, round(n)) for n in lengths), reverse=True)
    if not ends:
        return 0.0
    # Finish times under longest-first admission: slot s runs sequences s, s+slots, ... back to back.
    finish = []
    free = [0] * min(slots, len(ends))
    for n in ends:
        k = min(range(len(free)), key=lambda j: (free[j], j))
        free[k] += n
        finish.append(free[k])
    horizon = max(finish)
    # live rows at step t = sequences running then; sum over steps of cost(live rows).
    starts = [f - n for f, n in zip(finish, ends, strict=True)]
    events = [0] * (horizon + 1)
    for s, f in zip(starts, finish, strict=True):
        events[s] += 1
        events[f] -= 1
    total, live = 0.0, 0
    for t in range(horizon):
        live += events[t]
        total += cost.step_seconds(live)
    return total
