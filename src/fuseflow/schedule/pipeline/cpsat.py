"""OR-Tools CP-SAT models of the fused pipeline problem, used where list scheduling is weak.

Measured on two shared cores: CP-SAT proves a set of memory caps infeasible in
milliseconds and solves mid-sized capped models (about 400 tasks) in seconds, where the
randomised list scheduler can wander for a minute; on 32+ micro-batches it is the other
way round. The solver therefore asks both (see solver.py).

Every model shares the same core: one start variable per task with the window its
dependency chains allow inside the horizon, one no-overlap per device and one linear
precedence per graph edge (including posted structural edges).
"""

from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from fuseflow.schedule.pipeline.graph import TaskGraph
from fuseflow.schedule.pipeline.heuristic import earliest_start, latest_finish

MEM_SCALE = 1000  # memory is integer in CP-SAT: units of 1/1000


@dataclass
class CpOutcome:
    """`status` is "solved", "infeasible" (proved) or "unknown" (time ran out)."""

    status: str
    start: list[int] | None = None
    bound: float | None = None  # proved lower bound on the objective, in memory units


class _Model:
    def __init__(self, g: TaskGraph, horizon: int) -> None:
        self.g = g
        self.m = cp_model.CpModel()
        est = earliest_start(g)
        lf = latest_finish(g, horizon)
        self.empty = any(est[i] > lf[i] - g.dur[i] for i in range(g.n))
        if self.empty:
            return
        self.s = [self.m.new_int_var(est[i], lf[i] - g.dur[i], f"s{i}") for i in range(g.n)]
        iv = [self.m.new_fixed_size_interval_var(self.s[i], g.dur[i], f"iv{i}") for i in range(g.n)]
        for ids in g.on_device:
            self.m.add_no_overlap([iv[i] for i in ids])
        for b in range(g.n):
            for a in g.pred[b]:
                self.m.add(self.s[a] + g.dur[a] <= self.s[b])
        self.horizon = horizon

    def memory(self) -> cp_model.IntVar:
        """Peak activation memory over all devices, exactly (a cumulative per device:
        micro-batch j holds its memory from its forward's start to its backward's end)."""
        g, m = self.g, self.m
        cap = m.new_int_var(0, MEM_SCALE * 10**6, "peak")
        for ids in g.on_device:
            intervals, demands = [], []
            for i in ids:
                t = g.tasks[i]
                if t.backward:
                    continue
                b = g.index[t._replace(backward=True)]
                size = m.new_int_var(0, self.horizon, "")
                intervals.append(m.new_interval_var(self.s[i], size, self.s[b] + g.dur[b], ""))
                demands.append(round(g.inst.mem(t.model) * MEM_SCALE))
            m.add_cumulative(intervals, demands, cap)
        return cap

    def run(self, budget: float, hint: list[int] | None, seed: int) -> tuple[cp_model.CpSolver, int]:
        if hint is not None:
            for var, value in zip(self.s, hint, strict=True):
                self.m.add_hint(var, value)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.05, budget)
        solver.parameters.num_workers = 2
        solver.parameters.random_seed = seed
        return solver, solver.solve(self.m)


def _outcome(model: _Model, solver: cp_model.CpSolver, status: int, bound: float | None = None) -> CpOutcome:
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return CpOutcome("solved", [solver.value(v) for v in model.s], bound)
    if status == cp_model.INFEASIBLE:
        return CpOutcome("infeasible")
    return CpOutcome("unknown")


def feasible(g: TaskGraph, horizon: int, budget: float, hint: list[int] | None = None, seed: int = 0) -> CpOutcome:
    """A schedule of `g` (with its posted edges) ending by `horizon`, if one is found."""
    model = _Model(g, horizon)
    if model.empty:
        return CpOutcome("infeasible")
    solver, status = model.run(budget, hint, seed)
    return _outcome(model, solver, status)


def within_memory(
    g: TaskGraph, horizon: int, cap: float, budget: float, hint: list[int] | None = None, seed: int = 0
) -> CpOutcome:
    """A schedule ending by `horizon` whose exact peak memory is at most `cap`."""
    model = _Model(g, horizon)
    if model.empty:
        return CpOutcome("infeasible")
    model.m.add(model.memory() <= round(cap * MEM_SCALE))
    solver, status = model.run(budget, hint, seed)
    return _outcome(model, solver, status)


def min_memory(
    g: TaskGraph, horizon: int, budget: float, hint: list[int] | None, below: float, seed: int = 0
) -> CpOutcome:
    """Schedule ending by `horizon` with the least exact peak memory, which must be < `below`.

    Unlike `within_memory` this leaves the model free of structural caps; started from a
    good incumbent it is the stage that found the lowest peaks on 16-micro-batch instances.
    """
    model = _Model(g, horizon)
    if model.empty:
        return CpOutcome("infeasible")
    peak = model.memory()
    model.m.add(peak <= round(below * MEM_SCALE) - 1)
    model.m.minimize(peak)
    solver, status = model.run(budget, hint, seed)
    bound = solver.best_objective_bound / MEM_SCALE if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None
    return _outcome(model, solver, status, bound)
