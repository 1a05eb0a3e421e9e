"""Peak activation memory as a hard cap on the fused schedule (`solve(..., memory_cap=M)`).

Without a cap the solver minimises makespan first and memory second; with a cap every
schedule it keeps must hold at most `M` on every device, so a user trades makespan for
memory. Three pieces:

- `check_cap`: the least peak any schedule can have is one micro-batch of the heavier
  model (every device runs a forward and backward of both models; running each
  micro-batch's forward and backward before the next forward, one model after the other,
  holds exactly one at a time). A cap below it is infeasible: one clear error, before
  any search.
- `one_at_a_time`: that schedule, so a capped solve always has an incumbent under the cap.
- `min_makespan`: CP-SAT shortening the makespan under the cap, with the exact peak as a
  cumulative constraint per device (on models small enough for CP-SAT to move).
"""

from __future__ import annotations

import math

from fuseflow.schedule.pipeline import cpsat
from fuseflow.schedule.pipeline.graph import TaskGraph
from fuseflow.schedule.pipeline.problem import PipelineInstance, Task, evaluate


class InfeasibleCap(ValueError):
    """No schedule of the instance keeps its peak memory within the cap."""


def least_peak(inst: PipelineInstance) -> float:
    """The smallest peak activation memory of any schedule of `inst` (module docstring)."""
    return max(inst.mem_a, inst.mem_b)


def check_cap(inst: PipelineInstance, cap: float) -> None:
    """Raise InfeasibleCap (one line, with the fix) if no schedule fits in `cap`."""
    if not (isinstance(cap, (int, float)) and math.isfinite(cap)):
        raise InfeasibleCap(f"memory cap {cap!r} is not a finite number")
    low = least_peak(inst)
    if cap < low - 1e-9:
        raise InfeasibleCap(
            f"memory cap {cap:g} is infeasible for {inst.spec()}: every schedule holds at least one "
            f"micro-batch of the heavier model ({low:g}) on some device; use --memory-cap >= {low:g}"
        )


def one_at_a_time(inst: PipelineInstance) -> dict[Task, int]:
    """Start times of the schedule that holds one micro-batch at a time on every device:
    A's micro-batches one by one (forward through all stages, backward back), then B's."""
    order = []
    for d in range(inst.n_devices):
        seq = []
        for model in ("A", "B"):
            for t in inst.tasks_on(d):
                if t.model == model and not t.backward:
                    seq += [t, t._replace(backward=True)]
        order.append(seq)
    return evaluate(inst, order).start


def capped_serial(inst: PipelineInstance, cap: float) -> dict[Task, int] | None:
    """Start times of serial 1F1B with each model's in-flight micro-batches limited so that
    one model's activations fit in `cap` (A, then B; a stage never holds both at once):
    stage s warms up with min(p - s, k) - 1 forwards, k = floor(cap / mem). None if k < 1.
    Under tight caps it is far shorter than one micro-batch at a time."""
    from fuseflow.schedule.pipeline.baselines import one_f_one_b
    from fuseflow.schedule.pipeline.structure import stage_on

    order = [[] for _ in range(inst.n_devices)]
    for model in ("A", "B"):
        mem = inst.mem(model)
        k = inst.micro_batches(model) if mem == 0 else math.floor(cap / mem + 1e-9)
        if k < 1:
            return None
        p = inst.stages(model)
        for d in range(inst.n_devices):
            r, st = stage_on(inst, model, d)
            # one_f_one_b(p', ...) at stage p' - w - 1 warms up with w forwards.
            w = min(p - st, k) - 1
            order[d] += [Task(model, r, j, st, bw) for bw, j in one_f_one_b(w + 1, inst.micro_batches(model), 0)]
    return evaluate(inst, order).start


def min_makespan(
    g: TaskGraph, horizon: int, cap: float, effort: cpsat.Effort, hint: list[int] | None, seed: int = 0
) -> cpsat.CpOutcome:
    """Shortest schedule of `g` ending by `horizon` whose exact peak stays within `cap`."""
    model = cpsat._Model(g, horizon)
    if model.empty:
        return cpsat.CpOutcome("infeasible")
    peak = model.memory()
    model.m.add(peak <= math.floor(cap * cpsat.MEM_SCALE + 1e-6))
    span = model.m.new_int_var(0, horizon, "makespan")
    for i in range(g.n):
        model.m.add(model.s[i] + g.dur[i] <= span)
    model.m.minimize(span)
    solver, status = model.run(effort, hint, seed)
    return cpsat._outcome(model, solver, status, effort)
