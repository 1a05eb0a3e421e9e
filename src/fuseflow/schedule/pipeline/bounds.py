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

from fuseflow.policy.pipeline import arrival_and_tail, single_model_makespan
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
        """The bound itself, in integer time units: the largest of the four terms."""
        return max(self.critical_path, self.average_work, self.busiest_device, self.arrival_work_tail)


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
        arrival, tail = arrival_and_tail(d, inst.p_b, inst.f_a, inst.f_b)
        value = arrival + works[d] + tail
        if value > best:
            best, tight = value, d
    return LowerBound(critical, average, busiest, best, tight)
