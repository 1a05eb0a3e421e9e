"""Baseline schedules: serial 1F1B (one model after the other) and a greedy fused list schedule.

Both are the yardsticks the solver is measured against. `serial_1f1b` is what a framework
without intra-stage fusion does: train the actor with its own 1F1B pipeline, then the
critic with its own, each flushing before the other starts. `greedy_fused` is the obvious
fused schedule: every device runs whatever is ready, backward first, with each model's
in-flight micro-batches capped like 1F1B; it shows how much the search adds.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuseflow.policy.pipeline import single_model_makespan
from fuseflow.schedule.pipeline.graph import TaskGraph
from fuseflow.schedule.pipeline.problem import (
    Evaluation,
    Order,
    PipelineInstance,
    Task,
    check_order,
    device_peaks,
    order_from_times,
)
from fuseflow.schedule.pipeline.structure import cap_edges, stage_on


def one_f_one_b(p: int, m: int, stage: int) -> list[tuple[bool, int]]:
    """1F1B sequence of one stage as (backward?, micro_batch) pairs.

    Stage `s` of `p` warms up with `p - s - 1` forwards, then alternates forward/backward,
    then drains the remaining backwards, so it never holds more than `p - s` micro-batches.
    Example: `one_f_one_b(2, 3, 0)` is F0 F1 B0 F2 B1 B2.
    """
    warmup = min(p - stage - 1, m)
    seq = [(False, j) for j in range(warmup)]
    for i in range(m - warmup):
        seq += [(False, warmup + i), (True, i)]
    seq += [(True, j) for j in range(m - warmup, m)]
    return seq


def single_model_orders(inst: PipelineInstance, model: str) -> Order:
    """Each device's 1F1B sequence for one model alone (other model's tasks left out)."""
    p, m = inst.stages(model), inst.micro_batches(model)
    orders: Order = []
    for d in range(inst.n_devices):
        if model == "A":
            replica, stage = 0, d
        else:
            replica, stage = divmod(d, inst.p_b)[0], inst.p_b - 1 - d % inst.p_b
        orders.append([Task(model, replica, j, stage, bw) for bw, j in one_f_one_b(p, m, stage)])
    return orders


@dataclass
class TimedSchedule:
    """A schedule with explicit start times (baselines may insert a barrier the order cannot show)."""

    order: Order
    start: dict[Task, int]
    makespan: int
    device_peaks: list[float]  # (N,)

    @property
    def peak_memory(self) -> float:
        """Largest per-device peak of activation memory, in the instance's memory units."""
        return max(self.device_peaks)

    @classmethod
    def from_evaluation(cls, order: Order, ev: Evaluation) -> TimedSchedule:
        """The schedule that `evaluate` timed for `order`: its start times, makespan and per-device
        peaks, copied so the result does not share them with `ev`."""
        return cls(order, dict(ev.start), ev.makespan, list(ev.device_peaks))


def _asap(inst: PipelineInstance, orders: Order, offset: int) -> dict[Task, int]:
    """Earliest start times of per-device orders of one model, shifted by `offset`."""
    end: dict[Task, int] = {}
    start: dict[Task, int] = {}
    free = [offset] * len(orders)
    pos = [0] * len(orders)
    left = sum(map(len, orders))
    while left:
        moved = False
        for d, seq in enumerate(orders):
            while pos[d] < len(seq) and all(p in end for p in inst.predecessors(seq[pos[d]])):
                t = seq[pos[d]]
                s = max([free[d]] + [end[p] for p in inst.predecessors(t)])
                start[t], end[t] = s, s + inst.duration(t)
                free[d] = end[t]
                pos[d] += 1
                left -= 1
                moved = True
        if not moved:  # cannot happen for 1F1B orders; guards against a broken generator
            raise RuntimeError("1F1B order deadlocked")
    return start


def serial_1f1b(inst: PipelineInstance) -> TimedSchedule:
    """Model A's 1F1B, a flush, then model B's 1F1B (all B replicas in parallel).

    Its makespan has the closed form (mA + pA - 1)*3fA + (mB + pB - 1)*3fB.
    """
    orders_a = single_model_orders(inst, "A")
    orders_b = single_model_orders(inst, "B")
    start = _asap(inst, orders_a, 0)
    span_a = max(s + inst.duration(t) for t, s in start.items())
    start_b = _asap(inst, orders_b, span_a)
    start.update(start_b)
    order = [a + b for a, b in zip(orders_a, orders_b, strict=True)]
    check_order(inst, order)
    makespan = max(s + inst.duration(t) for t, s in start.items())
    return TimedSchedule(order, start, makespan, device_peaks(inst, order))


def serial_1f1b_makespan(inst: PipelineInstance) -> int:
    """Closed form of `serial_1f1b(inst).makespan`."""
    return single_model_makespan(inst.p_a, inst.m_a, inst.f_a) + single_model_makespan(
        inst.p_b, inst.m_b, inst.f_b
    )


def greedy_fused(inst: PipelineInstance) -> TimedSchedule:
    """Non-delay list schedule of both models at once, with 1F1B in-flight caps.

    Repeatedly starts, among all tasks whose dependencies are done, the one that can start
    earliest; ties go to backwards (they free memory and unblock the drain), then model A,
    then the lower micro-batch. Each model keeps at most p - s micro-batches in flight on
    stage s, as in its own 1F1B.
    """
    g = TaskGraph(inst)
    caps = {
        (d, model): (inst.stages(model) - stage_on(inst, model, d)[1], False)
        for d in range(inst.n_devices)
        for model in ("A", "B")
    }
    g = g.with_edges(cap_edges(g, caps))
    waiting = [len(p) for p in g.pred]
    release = [0] * g.n
    ready: list[set[int]] = [set() for _ in range(inst.n_devices)]
    for i in range(g.n):
        if not waiting[i]:
            ready[g.dev[i]].add(i)
    free = [0] * inst.n_devices
    start = [0] * g.n

    def key(i: int) -> tuple[int, bool, str, int]:
        t = g.tasks[i]
        return (max(free[g.dev[i]], release[i]), not t.backward, t.model, t.micro_batch)

    for _ in range(g.n):
        i = min((min(r, key=key) for r in ready if r), key=key)
        d = g.dev[i]
        ready[d].discard(i)
        start[i] = max(free[d], release[i])
        free[d] = start[i] + g.dur[i]
        for s in g.succ[i]:
            release[s] = max(release[s], free[d])
            waiting[s] -= 1
            if not waiting[s]:
                ready[g.dev[s]].add(s)
    timed = g.times_to_tasks(start)
    order = order_from_times(inst, timed)
    makespan = max(free)
    return TimedSchedule(order, timed, makespan, device_peaks(inst, order))
