"""Solver for fused pipeline schedules: makespan first, then peak memory, then the sum of peaks.

Two engines, each used where we measured it to be strong (docs/benchmarks.md):
randomised forward-backward list scheduling (heuristic.py; fast on long pipelines) and
OR-Tools CP-SAT (cpsat.py; proves memory caps infeasible in milliseconds and solves
models of a few hundred tasks). Four stages share one time budget and one incumbent:

1. makespan: list scheduling towards the lower bound, CP-SAT if it stalls above it;
2. memory by structure: binary search on a memory target; each target becomes caps
   (`structure.caps_for_target`: the heavier model in strict 1F1B, the other capped) and
   a schedule keeping stage 1's makespan under them is sought by both engines;
3. exact memory (models up to CP_MEMORY_MAX_TASKS tasks): CP-SAT minimises the exact
   peak, a cumulative constraint per device, starting from the incumbent;
4. flattening: with the time left, post one edge at a time that makes the forward
   reaching the highest peak wait for an in-flight backward, kept if the makespan holds
   ("precedence constraint posting").

The result is re-timed by the reference evaluator. Runs are seeded, but CP-SAT's two
workers and the wall-clock budget make results vary a little between runs and machines.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fuseflow.schedule.pipeline import cpsat, heuristic
from fuseflow.schedule.pipeline.bounds import lower_bound
from fuseflow.schedule.pipeline.graph import CycleError, TaskGraph, device_peaks_of
from fuseflow.schedule.pipeline.problem import PipelineInstance, Task, evaluate, order_from_times
from fuseflow.schedule.pipeline.structure import (
    cap_edges,
    caps_for_exact,
    caps_for_target,
    peak_point,
    primary_model,
)

Progress = Callable[[str, int, float], None]  # (stage, makespan, peak memory)
CP_MEMORY_MAX_TASKS = 1600  # above this the exact-memory CP model rarely improves in time


@dataclass
class SolveResult:
    """Best schedule found, with how it was reached."""

    start: dict[Task, int]
    makespan: int
    device_peaks: list[float]  # (N,)
    lower_bound: int
    seconds: float
    history: list[tuple[float, str, int, float]] = field(default_factory=list)  # (t, stage, makespan, peak)

    @property
    def peak_memory(self) -> float:
        return max(self.device_peaks)


def _score(makespan: int, peaks: list[float]) -> tuple[int, float, int, float]:
    """Lexicographic objective; the count of devices at the peak breaks plateaus."""
    top = max(peaks)
    return (makespan, round(top, 9), sum(1 for p in peaks if p >= top - 1e-9), round(sum(peaks), 9))


class _Search:
    """State shared by the stages: instance graph, clock, random stream, incumbent."""

    def __init__(self, inst: PipelineInstance, seconds: float, seed: int, progress: Progress | None):
        self.inst = inst
        self.g0 = TaskGraph(inst)
        self.lb = lower_bound(inst).value
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + seconds
        self.seed = seed
        self.rng = random.Random(seed)
        self.progress = progress
        f_min = min(inst.f_a, inst.f_b)
        self.noise = [0.5 * f_min, f_min, 2 * f_min, 4 * f_min]
        self.best_start: list[int] = []
        self.best_edges: list[tuple[int, int]] = []
        self.best_score: tuple[int, float, int, float] | None = None
        self.history: list[tuple[float, str, int, float]] = []

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    @property
    def peak(self) -> float:
        return self.best_score[1] if self.best_score else float("inf")

    def offer(self, stage: str, start: list[int], edges: list[tuple[int, int]]) -> bool:
        """Keep `start` (found under posted `edges`) if it beats the incumbent."""
        makespan = max(s + d for s, d in zip(start, self.g0.dur, strict=True))
        score = _score(makespan, device_peaks_of(self.g0, start))
        if self.best_score is not None and score >= self.best_score:
            return False
        self.best_score, self.best_start, self.best_edges = score, list(start), list(edges)
        self.history.append((round(time.perf_counter() - self.t0, 3), stage, makespan, score[1]))
        if self.progress:
            self.progress(stage, makespan, score[1])
        return True

    def heuristic(
        self, g: TaskGraph, prio: list[float], target: int, budget: float, by_makespan: bool = False
    ) -> tuple[int, list[int]]:
        budget = max(0.0, min(budget, self.left()))
        return heuristic.search(g, prio, target, budget, self.rng, self.noise, by_makespan=by_makespan)


def _stage_makespan(sr: _Search, share: float) -> int:
    g = sr.g0
    span, start = sr.heuristic(g, [0.0] * g.n, sr.lb, sr.left() * share)
    sr.offer("makespan", start, [])
    if span > sr.lb and sr.left() > 1:
        # A pure feasibility question at the bound: CP-SAT answered these in about a second
        # on the 8-device instances. No hint: a near-miss hint made it time out (15 s vs 1.7 s).
        out = cpsat.feasible(g, sr.lb, sr.left() * share, None, sr.seed)
        if out.status == "solved":
            sr.offer("makespan-cp", out.start, [])
    return sr.best_score[0]


def _probe(sr: _Search, makespan: int, target: float, budget: float, warm: bool) -> tuple[list[int], list] | None:
    """Look for a schedule keeping `makespan` with peak memory near `target`.

    Tries list scheduling under conservative caps, then CP-SAT under the same caps, then,
    on small models, CP-SAT with looser caps plus the exact memory constraint. Returns
    (start, posted edges) or None.
    """
    inst, g0 = sr.inst, sr.g0
    stop = time.perf_counter() + budget
    caps = caps_for_target(inst, target)
    if caps is not None:
        edges = cap_edges(g0, caps)
        g = g0.with_edges(edges)
        # Warm start from the last success, then a cold start judged by makespan (on the
        # suite each found schedules the other missed). Aim at the bound even if stage 1
        # missed it: a structured schedule may reach it.
        for prio in ([sr.best_start, [0.0] * g.n] if warm else [[0.0] * g.n]):
            cold = prio is not sr.best_start
            span, start = sr.heuristic(g, prio, sr.lb, (stop - time.perf_counter()) / 3, by_makespan=cold)
            if span <= makespan:
                return start, edges
        room = stop - time.perf_counter()
        out = cpsat.feasible(g, makespan, room * (0.6 if g0.n <= CP_MEMORY_MAX_TASKS else 1.0), None, sr.seed)
        if out.status == "solved":
            return out.start, edges
    exact = caps_for_exact(inst, target)
    room = stop - time.perf_counter()
    if exact is not None and g0.n <= CP_MEMORY_MAX_TASKS and room > 0.2:
        edges = cap_edges(g0, exact)
        out = cpsat.within_memory(g0.with_edges(edges), makespan, target, room, None, sr.seed)
        if out.status == "solved":
            return out.start, edges
    return None


def _stage_targets(sr: _Search, share: float) -> None:
    """Tighten a memory target step by step, each step warm-started from the last success.

    The first target is `2 * floor`, where `floor` is the smallest target that still lets
    the heavier model run its full 1F1B next to one micro-batch of the other; each success
    halves the distance from its exact peak to `floor`. Small steps matter: a schedule
    under the previous caps is nearly one under the next, so repairing it is quick, while
    a cold start at a tight target often is not. A miss retries halfway back, up to three
    times in a row (once on big models, where a miss costs a whole probe and flattening
    uses the time better).
    """
    inst = sr.inst
    stop = time.perf_counter() + sr.left() * share
    prim = primary_model(inst)
    sec = "B" if prim == "A" else "A"
    floor = inst.stages(prim) * inst.mem(prim) + inst.mem(sec)
    resolution = min(m for m in (inst.mem_a, inst.mem_b, 1.0) if m > 0) / 4
    target, ceiling, warm, misses = min(sr.peak - resolution, 2 * floor), sr.peak, False, 0
    allowed = 1 if sr.g0.n > CP_MEMORY_MAX_TASKS else 3  # big models: one miss, then flattening
    while time.perf_counter() < stop and ceiling - target >= resolution:
        found = _probe(sr, sr.best_score[0], target, min(15.0, stop - time.perf_counter()), warm)
        if found is None:
            misses += 1
            if misses >= allowed:
                return
            target = (target + ceiling) / 2
            continue
        start, edges = found
        sr.offer("memory-caps", start, edges)
        ceiling = max(device_peaks_of(sr.g0, start))
        target = floor + (ceiling - floor) / 2 if ceiling > floor + resolution else ceiling - 2 * resolution
        warm, misses = True, 0


def _stage_exact(sr: _Search, makespan: int, share: float) -> None:
    """CP-SAT minimising the exact peak from the incumbent (small models only)."""
    if sr.g0.n > CP_MEMORY_MAX_TASKS or sr.left() < 1:
        return
    out = cpsat.min_memory(sr.g0, makespan, sr.left() * share, sr.best_start, sr.peak, sr.seed)
    if out.status == "solved":
        sr.offer("memory-exact", out.start, [])


def _stage_flatten(sr: _Search, makespan: int) -> None:
    """Precedence constraint posting on the highest memory peaks until time runs out.

    An edge is kept when the schedule found with it keeps the makespan and is no worse
    (plateau moves are allowed: edges only accumulate, so this cannot cycle); the
    incumbent only changes on a strict improvement.
    """
    g0 = sr.g0
    cur, edges = sr.best_start, sr.best_edges
    cur_score = _score(makespan, device_peaks_of(g0, cur))
    stuck: set[tuple[int, int]] = set()
    while sr.left() > 0.2:
        peaks = device_peaks_of(g0, cur)
        top = max(peaks)
        accepted = False
        for d in (d for d in range(len(peaks)) if peaks[d] >= top - 1e-9):
            _, fwd, live = peak_point(g0, cur, d)
            # Delay the peak's forward behind an in-flight backward, soonest-ending first.
            for bwd in sorted(live, key=cur.__getitem__):
                if (bwd, fwd) in stuck or sr.left() <= 0.2:
                    continue
                stuck.add((bwd, fwd))
                trial = edges + [(bwd, fwd)]
                try:
                    span, new = sr.heuristic(g0.with_edges(trial), cur, makespan, max(2.0, g0.n / 800))
                except CycleError:
                    continue
                score = _score(span, device_peaks_of(g0, new))
                if span <= makespan and score <= cur_score:
                    sr.offer("memory-flatten", new, trial)
                    edges, cur, cur_score, accepted = trial, new, score, True
                    break
            if accepted:
                break
        if not accepted:
            return


def solve(
    inst: PipelineInstance,
    seconds: float = 60.0,
    seed: int = 0,
    progress: Progress | None = None,
) -> SolveResult:
    """Fused schedule minimising makespan, then peak memory, then the sum of peaks.

    Runs for at most `seconds` (it stops early only if a stage has nothing left to try).
    Example: `solve(PipelineInstance.parse("8,4,8,4,5,4,1.95,2"), seconds=10).makespan`.
    """
    if seconds <= 0:
        raise ValueError(f"seconds={seconds!r} is invalid: it must be > 0")
    sr = _Search(inst, seconds, seed, progress)
    _stage_makespan(sr, share=0.15)
    _stage_targets(sr, share=0.55)
    _stage_exact(sr, sr.best_score[0], share=0.7)
    _stage_flatten(sr, sr.best_score[0])
    # Re-time the best order with the reference evaluator: it is the source of truth.
    g0 = sr.g0
    order = order_from_times(inst, g0.times_to_tasks(sr.best_start))
    ev = evaluate(inst, order)
    return SolveResult(
        start=dict(ev.start),
        makespan=ev.makespan,
        device_peaks=list(ev.device_peaks),
        lower_bound=sr.lb,
        seconds=round(time.perf_counter() - sr.t0, 3),
        history=sr.history,
    )
