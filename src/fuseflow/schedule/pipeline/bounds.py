"""Lower bound on the makespan of any fused schedule.

The bound is the largest of four terms (the issue's definition). The per-device term is
what makes the RLHFuse instances tight: a device cannot start before the first forward of
either model reaches it, must then run all its work, and its last task is a backward whose
gradient still has to travel down to stage 0 of that model. Because either model may own
the first or the last task, both the arrival and the tail are minimised over the two
models independently. With that reading the bound reproduces the published values
708, 372, 225, 702, 366 and 225.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuseflow.schedule.pipeline.problem import PipelineInstance


@dataclass(frozen=True)
class LowerBound:
    """The bound and its four terms, kept apart so reports can say which one binds."""

    critical_path: int  # single-model pipeline bound of the larger model: (m+p-1) * 3f
    average_work: int  # total work / devices, rounded up (times are integers)
    busiest_device: int  # work of the most loaded device
    arrival_work_tail: int  # max over devices of min arrival + work + min backward tail
    tight_device: int  # device that attains `arrival_work_tail`

    @property
    def value(self) -> int:
        return max(self.critical_path, self.average_work, self.busiest_device, self.arrival_work_tail)


def single_model_makespan(p: int, m: int, f: int) -> int:
    """Makespan of one model alone under 1F1B with backward = 2 * forward.

    It is also that model's critical-path bound: stage p-1 gets its first input after
    (p-1)*f, runs m*(f+2f) of work, and its last gradient needs (p-1)*2f more to reach
    stage 0, which sums to (m + p - 1) * 3f. Example: p=8, m=8, f=5 gives 225.
    """
    return (m + p - 1) * 3 * f


def arrival_and_tail(inst: PipelineInstance, device: int) -> tuple[int, int]:
    """Earliest time any work can reach `device`, and the shortest backward tail after its
    last task (the last task of a device is always a backward, which must then reach stage 0)."""
    s_a = device
    s_b = inst.p_b - 1 - device % inst.p_b
    arrival = min(s_a * inst.f_a, s_b * inst.f_b)
    tail = min(s_a * 2 * inst.f_a, s_b * 2 * inst.f_b)
    return arrival, tail


def lower_bound(inst: PipelineInstance) -> LowerBound:
    """Compute the four-term lower bound; `.value` is the bound itself.

    Example: for "8,4,32,16,5,4,1.95,2" every device has 672 units of work, and device 4
    (A stage 4, B stage 3) cannot start before 12 and needs a 24-unit tail: 708.
    """
    n = inst.n_devices
    critical = max(
        single_model_makespan(inst.p_a, inst.m_a, inst.f_a),
        single_model_makespan(inst.p_b, inst.m_b, inst.f_b),
    )
    works = [inst.device_work(d) for d in range(n)]
    total = sum(works)
    average = -(-total // n)
    busiest = max(works)
    best, tight = -1, 0
    for d in range(n):
        arrival, tail = arrival_and_tail(inst, d)
        value = arrival + works[d] + tail
        if value > best:
            best, tight = value, d
    return LowerBound(critical, average, busiest, best, tight)
