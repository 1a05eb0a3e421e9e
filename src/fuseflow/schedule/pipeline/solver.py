"""Solver for fused pipeline schedules: makespan first, then peak memory, then the sum of peaks.

Two engines, each used where we measured it to be strong (docs/benchmarks.md):
randomised forward-backward list scheduling (heuristic.py; fast on long pipelines) and
OR-Tools CP-SAT (cpsat.py; settles feasibility at the bound, repairs a schedule whose
caps were tightened, and minimises exact memory on models of a few hundred tasks). The
stages share one incumbent:

1. makespan: list scheduling towards the lower bound, first with the heavier model in
   strict 1F1B (a good start for the memory stages too), then unconstrained; CP-SAT
   feasibility at the bound if both stall above it;
2. memory (memory.py): cap descent, exact-memory CP-SAT, flattening.

Effort is counted in rounds and CP-SAT deterministic seconds, so a seeded solve returns
the same schedule on an idle or a loaded machine; `seconds` is a safety stop, and
`SolveResult.deterministic` says whether it fired.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fuseflow.schedule.pipeline import cpsat, memcap, memory
from fuseflow.schedule.pipeline.heuristic import latest_finish
from fuseflow.schedule.pipeline.problem import PipelineInstance, Task, evaluate, order_from_times
from fuseflow.schedule.pipeline.state import Progress, Search
from fuseflow.schedule.pipeline.structure import cap_edges, caps_for_target

MAKESPAN_WORK = 3_000_000  # task-rounds per start in the makespan stage (3000 rounds on 1024 tasks)
CP_FEASIBLE_DET = 5.0  # deterministic seconds for CP-SAT feasibility at the bound
# Above this many tasks a cold CP-SAT feasibility search at the bound did not finish in
# 30 CPU seconds ("16,16,64,64,...": 3,072 tasks) and left the memory stages no time.
CP_FEASIBLE_MAX_TASKS = 1600
# Under a memory cap the uncapped stages (which often end within the cap: they minimise
# memory too) get this share of the safety stop; the capped stages get the rest.
CAP_FIRST_SHARE = 0.6


@dataclass
class SolveResult:
    """Best schedule found, with how it was reached."""

    start: dict[Task, int]
    makespan: int
    device_peaks: list[float]  # (N,)
    lower_bound: int
    seconds: float
    history: list[tuple[float, str, int, float]] = field(default_factory=list)  # (t, stage, makespan, peak)
    deterministic: bool = True  # False if the wall-clock safety stop cut a search short

    @property
    def peak_memory(self) -> float:
        """Largest per-device peak of activation memory of the schedule, in the instance's memory units."""
        return max(self.device_peaks)


def _stage_makespan(sr: Search) -> None:
    """Reach the lower bound if possible; keeps the best makespan found otherwise."""
    inst, g0, rl = sr.inst, sr.g0, sr.roles
    # Generous caps: the heavier model in strict 1F1B, the other one loosely capped.
    # On the 32-micro-batch instances this graph reached the bound from its first
    # latest-start order, where the unconstrained one stalled one unit above it.
    caps = caps_for_target(inst, rl, 2 * (inst.stages(rl.primary) * inst.mem(rl.primary) + inst.mem(rl.secondary)))
    graphs = ([cap_edges(g0, caps)] if caps is not None else []) + [[]]
    for edges in graphs:
        g = g0.with_edges(edges)
        lf = latest_finish(g, sr.lb)
        span, start = sr.heuristic(g, [lf[i] - g.dur[i] for i in range(g.n)], sr.lb, sr.rounds_for(MAKESPAN_WORK))
        sr.offer("makespan", start, edges)
        if span <= sr.lb:
            return
    for edges in graphs:
        if sr.left() < 0.5 or g0.n > CP_FEASIBLE_MAX_TASKS:
            return
        # A pure feasibility question at the bound. No hint: for this cold question a
        # near-miss hint made CP-SAT time out (15 s vs 1.7 s without).
        out = sr.note(cpsat.feasible(g0.with_edges(edges), sr.lb, sr.effort(CP_FEASIBLE_DET), None, sr.seed))
        if out.status == "solved":
            sr.offer("makespan-cp", out.start, edges)
            return


def _stage_capped(sr: Search, cap: float) -> None:
    """Once the uncapped stages ended above the cap: restart from the best schedule within
    it (the one-at-a-time schedule always fits), let CP-SAT shorten it with the exact peak
    constrained where the model is small, then search towards the bound under caps that
    fit in `cap` and run the memory stages again, every offer now held to the cap."""
    inst, g0 = sr.inst, sr.g0
    uncapped = sr.best_start
    for start in (memcap.capped_serial(inst, cap), memcap.one_at_a_time(inst)):
        if start is not None:
            sr.offer("memory-cap", [start[t] for t in g0.tasks], [])
    sr.restart_from_feasible()
    caps = caps_for_target(inst, sr.roles, cap)
    if caps is not None and sr.best_score[0] > sr.lb:
        edges = cap_edges(g0, caps)
        g = g0.with_edges(edges)
        lf = latest_finish(g, sr.lb)
        _, start = sr.heuristic(g, [lf[i] - g.dur[i] for i in range(g.n)], sr.lb, sr.rounds_for(MAKESPAN_WORK))
        sr.offer("makespan-capped", start, edges)
    if sr.best_score[0] > sr.lb and g0.n <= memory.CP_MEMORY_MAX_TASKS and sr.left() >= 0.5:
        # The uncapped schedule is a good hint: usually a few moves from one within the cap.
        out = sr.note(memcap.min_makespan(g0, sr.best_score[0], cap, sr.effort(memory.EXACT_DET), uncapped,
                                          sr.seed))
        if out.status == "solved":
            sr.offer("memory-cap-cp", out.start, [])
    memory.minimise(sr)


def solve(
    inst: PipelineInstance,
    seconds: float = 60.0,
    seed: int = 0,
    progress: Progress | None = None,
    memory_cap: float | None = None,
) -> SolveResult:
    """Fused schedule minimising makespan, then peak memory, then the sum of peaks.

    With `memory_cap` no device's peak may exceed it (a hard constraint, so makespan is
    traded for memory); a cap no schedule meets raises memcap.InfeasibleCap before any
    search. Stops when its stages have spent their effort or after `seconds`, whichever
    is first. Example: `solve(PipelineInstance.parse("8,4,8,4,5,4,1.95,2"), seconds=10).makespan`.
    """
    if seconds <= 0:
        raise ValueError(f"seconds={seconds!r} is invalid: it must be > 0")
    if memory_cap is not None:
        memcap.check_cap(inst, memory_cap)
    sr = Search(inst, seconds, seed, progress, cap=memory_cap)
    if memory_cap is not None:
        sr.deadline = sr.t0 + CAP_FIRST_SHARE * seconds  # leave the capped stages time of their own
    _stage_makespan(sr)
    memory.minimise(sr)
    if memory_cap is not None and sr.peak > memory_cap + 1e-9:
        sr.deadline = sr.t0 + seconds
        _stage_capped(sr, memory_cap)
    # Re-time the best order with the reference evaluator: it is the source of truth.
    order = order_from_times(inst, sr.g0.times_to_tasks(sr.best_start))
    ev = evaluate(inst, order)
    return SolveResult(
        start=dict(ev.start),
        makespan=ev.makespan,
        device_peaks=list(ev.device_peaks),
        lower_bound=sr.lb,
        seconds=round(time.perf_counter() - sr.t0, 3),
        history=sr.history,
        deterministic=not sr.cut,
    )
