"""Randomised forward-backward list scheduling: the solver's fast makespan engine.

One round list-schedules the tasks in the order of the incumbent's start times plus
random noise, then justifies the result (graph.justify). The round is kept when its
tardiness is no worse, where tardiness sums how far tasks end past the latest finish the
target makespan allows them (longest path to the end of the graph). Tardiness is zero
exactly when the makespan meets the target, and unlike the makespan it also counts the
tasks that are late but not last, so the walk gets a gradient instead of a plateau: on
"8,8,16,16,5,2,1.95,1" this reached the bound in 3/3 seeds where makespan-acceptance
reached it in 1/3.
"""

from __future__ import annotations

import random
import time

from fuseflow.schedule.pipeline.graph import CycleError, TaskGraph, justify, sgs


def earliest_start(g: TaskGraph) -> list[int]:
    """Earliest start of each task from its dependency chains alone (no device conflicts)."""
    indeg = [len(p) for p in g.pred]
    est = [0] * g.n
    stack = [i for i in range(g.n) if not indeg[i]]
    seen = 0
    while stack:
        i = stack.pop()
        seen += 1
        fin = est[i] + g.dur[i]
        for s in g.succ[i]:
            if fin > est[s]:
                est[s] = fin
            indeg[s] -= 1
            if not indeg[s]:
                stack.append(s)
    if seen < g.n:
        raise CycleError(f"{g.n - seen} tasks sit on a cycle of posted edges")
    return est


def latest_finish(g: TaskGraph, horizon: int) -> list[int]:
    """Latest end of each task that still lets every chain after it finish by `horizon`."""
    outdeg = [len(s) for s in g.succ]
    lf = [horizon] * g.n
    stack = [i for i in range(g.n) if not outdeg[i]]
    seen = 0
    while stack:
        i = stack.pop()
        seen += 1
        limit = lf[i] - g.dur[i]
        for p in g.pred[i]:
            if limit < lf[p]:
                lf[p] = limit
            outdeg[p] -= 1
            if not outdeg[p]:
                stack.append(p)
    if seen < g.n:
        raise CycleError(f"{g.n - seen} tasks sit on a cycle of posted edges")
    return lf


def tardiness(end: list[int], lf: list[int]) -> int:
    """Total lateness: how far each task ends past its latest finish `lf`, summed over the late
    ones (integer time units). Zero exactly when every task meets `lf`."""
    return sum(e - f for e, f in zip(end, lf, strict=True) if e > f)


def search(
    g: TaskGraph,
    prio: list[float],
    target: int,
    budget: float,
    rng: random.Random,
    noise: list[float],
    patience: int = 400,
    max_rounds: int = 2000,
) -> tuple[int, list[int], int, bool]:
    """Search for a schedule of `g` with makespan <= `target` in at most `max_rounds` rounds.

    Gives up early after `patience` rounds without lowering the tardiness (on the suite,
    successful searches improved far more often than that). The effort is counted in
    rounds so that a seeded search gives the same answer however loaded the machine is;
    `budget` (seconds) is only a safety stop. Returns (makespan, start times) of the least
    tardy schedule seen, the rounds used (the first one included) and whether the safety
    stop ended the search; `prio` seeds the first round (e.g. a previous schedule's start
    times). Raises CycleError for cyclic g.
    """
    stop = time.perf_counter() + budget
    lf = latest_finish(g, target)
    s, e = justify(g, *sgs(g, prio))
    best_t, best_s, best_e = tardiness(e, lf), s, e
    n = g.n
    stale = rounds = 0
    timed_out = False
    while best_t > 0 and stale < patience and rounds < max_rounds:
        if time.perf_counter() >= stop:
            timed_out = True
            break
        rounds += 1
        scale = rng.choice(noise)
        s, e = justify(g, *sgs(g, [best_s[i] + rng.random() * scale for i in range(n)]))
        t = tardiness(e, lf)
        stale = 0 if t < best_t else stale + 1
        if t <= best_t:
            best_t, best_s, best_e = t, s, e
    return max(best_e), best_s, rounds + 1, timed_out
