"""OR-Tools CP-SAT models of the fused pipeline problem, used where list scheduling is weak.

Measured on two shared cores: CP-SAT proves a set of memory caps infeasible in
milliseconds and solves mid-sized capped models (about 400 tasks) in seconds, where the
randomised list scheduler can wander for a minute. On 32+ micro-batches a cold CP-SAT
search is heavy-tailed (the same capped model took 0.04 or over 4 deterministic seconds
depending on the cap), but given the previous schedule as a hint it repairs a slightly
tightened cap in well under one deterministic second. The solver therefore asks both.

Every call runs one search worker with a deterministic time limit (CP-SAT's own work
measure), so the same call gives the same answer however loaded the machine is; the
wall-clock limit is only a safety stop. Two workers on two shared cores made results
depend on thread timing.

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
    """`status` is "solved", "infeasible" (proved) or "unknown" (effort ran out)."""

    status: str
    start: list[int] | None = None
    bound: float | None = None  # proved lower bound on the objective, in memory units
    deterministic: bool = True  # False when the wall-clock safety stop ended the search


@dataclass(frozen=True)
class Effort:
    """Limits of one CP-SAT call: `det` deterministic seconds and at most `conflicts`
    conflicts (both reproducible), `wall` seconds as a safety stop."""

    det: float
    wall: float
    conflicts: int | None = None


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

    def run(self, effort: Effort, hint: list[int] | None, seed: int) -> tuple[cp_model.CpSolver, int]:
        if hint is not None:
            for var, value in zip(self.s, hint, strict=True):
                self.m.add_hint(var, value)
        solver = cp_model.CpSolver()
        solver.parameters.max_deterministic_time = max(0.01, effort.det)
        solver.parameters.max_time_in_seconds = max(0.05, effort.wall)
        solver.parameters.num_workers = 1
        if effort.conflicts is not None:
            solver.parameters.max_number_of_conflicts = effort.conflicts
        solver.parameters.random_seed = seed
        # The LP relaxation re-solved thousands of times per repair, and the precedence
        # reasoning inside no-overlap was most of what was left: without both, a repair on
        # "8,8,32,32,5,2,1.95,1" took 0.45 CPU seconds instead of 2.5, same answer.
        solver.parameters.linearization_level = 0
        solver.parameters.use_precedences_in_disjunctive_constraint = False
        return solver, solver.solve(self.m)


def _outcome(
    model: _Model, solver: cp_model.CpSolver, status: int, effort: Effort, bound: float | None = None
) -> CpOutcome:
    # The wall stop fired if the search ended early in deterministic time without a proof.
    cut = status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE) and solver.wall_time >= 0.98 * effort.wall
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return CpOutcome("solved", [solver.value(v) for v in model.s], bound, not cut)
    if status == cp_model.INFEASIBLE:
        return CpOutcome("infeasible")
    return CpOutcome("unknown", deterministic=not cut)


def feasible(g: TaskGraph, horizon: int, effort: Effort, hint: list[int] | None = None, seed: int = 0) -> CpOutcome:
    """A schedule of `g` (with its posted edges) ending by `horizon`, if one is found.

    With `hint` (a schedule of a slightly looser graph) this is a repair: CP-SAT starts
    from it and moves only what the new edges break.
    """
    model = _Model(g, horizon)
    if model.empty:
        return CpOutcome("infeasible")
    solver, status = model.run(effort, hint, seed)
    return _outcome(model, solver, status, effort)


def min_memory(
    g: TaskGraph, horizon: int, effort: Effort, hint: list[int] | None, below: float, seed: int = 0
) -> CpOutcome:
    """Schedule ending by `horizon` with the least exact peak memory, which must be < `below`.

    Free of structural caps; started from a good incumbent it is the stage that found the
    lowest peaks on 8- and 16-micro-batch instances.
    """
    model = _Model(g, horizon)
    if model.empty:
        return CpOutcome("infeasible")
    peak = model.memory()
    model.m.add(peak <= round(below * MEM_SCALE) - 1)
    model.m.minimize(peak)
    solver, status = model.run(effort, hint, seed)
    bound = solver.best_objective_bound / MEM_SCALE if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None
    return _outcome(model, solver, status, effort, bound)
