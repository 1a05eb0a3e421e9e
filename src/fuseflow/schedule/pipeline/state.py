"""Search state shared by the solver's stages: graph, clock, random stream, incumbent.

Effort is counted in work units (list-scheduling rounds, CP-SAT deterministic seconds), so
a seeded solve gives the same schedule however loaded the machine is. The wall clock is
only a safety stop; `Search.cut` records whether it ever fired, which is the one way a
result can depend on load.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from fuseflow.schedule.pipeline import cpsat, heuristic
from fuseflow.schedule.pipeline.bounds import lower_bound
from fuseflow.schedule.pipeline.graph import TaskGraph, device_peaks_of
from fuseflow.schedule.pipeline.problem import PipelineInstance
from fuseflow.schedule.pipeline.structure import cap_edges, roles

Progress = Callable[[str, int, float], None]  # (stage, makespan, peak memory)
Score = tuple[int, float, int, float]


def score_of(makespan: int, peaks: list[float]) -> Score:
    """Lexicographic objective; the count of devices at the peak breaks plateaus."""
    top = max(peaks)
    return (makespan, round(top, 9), sum(1 for p in peaks if p >= top - 1e-9), round(sum(peaks), 9))


class Search:
    """Everything a stage needs: the instance graph, budgets, random stream and incumbent."""

    def __init__(self, inst: PipelineInstance, seconds: float, seed: int, progress: Progress | None,
                 cap: float | None = None):
        self.inst = inst
        # Hard cap on peak memory (memcap.py). The best schedule within it is kept apart
        # from the incumbent; once `enforce_cap` is set, offers above the cap are refused.
        self.cap = cap
        self.enforce_cap = False
        self.feasible: tuple[Score, list[int], list[tuple[int, int]]] | None = None
        self.g0 = TaskGraph(inst)
        self.roles = roles(inst)  # primary/secondary model and the primary's 1F1B caps, for every stage
        self.primary_edges = cap_edges(self.g0, self.roles.primary_caps)  # those caps as g0 edges (memory stages)
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
        self.best_score: Score | None = None
        self.history: list[tuple[float, str, int, float]] = []
        self.cut = False  # True once the wall-clock safety stop has ended some search early
        self.rounds_used = 0  # list-scheduling rounds run so far

    def left(self) -> float:
        """Seconds left before the wall-clock safety stop (negative once it has passed)."""
        return self.deadline - time.perf_counter()

    @property
    def peak(self) -> float:
        """Peak memory of the incumbent schedule (`inf` until one has been accepted)."""
        return self.best_score[1] if self.best_score else float("inf")

    def makespan_of(self, start: list[int]) -> int:
        """Makespan of `start` (start times indexed like `g0.tasks`): the latest task end."""
        return max(s + d for s, d in zip(start, self.g0.dur, strict=True))

    def offer(self, stage: str, start: list[int], edges: list[tuple[int, int]]) -> bool:
        """Keep `start` (found under posted `edges`) if it beats the incumbent."""
        score = score_of(self.makespan_of(start), device_peaks_of(self.g0, start))
        fits = self.cap is None or score[1] <= self.cap + 1e-9
        if fits and (self.feasible is None or score < self.feasible[0]):
            self.feasible = (score, list(start), list(edges))
        if self.enforce_cap and not fits:
            return False
        if self.best_score is not None and score >= self.best_score:
            return False
        self.best_score, self.best_start, self.best_edges = score, list(start), list(edges)
        self.history.append((round(time.perf_counter() - self.t0, 3), stage, score[0], score[1]))
        if self.progress:
            self.progress(stage, score[0], score[1])
        return True

    def restart_from_feasible(self) -> None:
        """Enforce the cap from now on, with the best schedule within it as the incumbent."""
        self.enforce_cap = True
        if self.feasible is not None:
            self.best_score, self.best_start, self.best_edges = self.feasible

    def rounds_for(self, work: int) -> int:
        """Rounds worth `work` task-rounds on this instance (a round costs about n tasks)."""
        return max(20, work // self.g0.n)

    def heuristic(
        self,
        g: TaskGraph,
        prio: list[float],
        target: int,
        rounds: int,
        patience: int = 400,
    ) -> tuple[int, list[int]]:
        """List-scheduling search for at most `rounds` rounds (see heuristic.search)."""
        makespan, start, used, timed_out = heuristic.search(
            g, prio, target, max(0.0, self.left()), self.rng, self.noise, patience, rounds
        )
        self.rounds_used += used
        if timed_out and makespan > target:
            self.cut = True
        return makespan, start

    def effort(self, det: float, conflicts: int | None = None) -> cpsat.Effort:
        """CP-SAT limits (see cpsat.Effort), stopped by the overall deadline at the latest."""
        return cpsat.Effort(det, max(0.05, self.left()), conflicts)

    def note(self, outcome: cpsat.CpOutcome) -> cpsat.CpOutcome:
        """Set `cut` if the wall-clock safety stop ended this CP-SAT call; returns `outcome` unchanged."""
        if not outcome.deterministic:
            self.cut = True
        return outcome
