"""Lower bounds on fused actor/critic pipeline schedules (RLHFuse intra-stage fusion).

Model A has ``p_a`` stages (stage s on device s); model C has ``p_c`` stages, replicated
``p_a / p_c`` times in the opposite direction. A backward takes twice a forward. The pieces
here are what both the schedule solver (``fuseflow.schedule.pipeline.bounds``, integer
forward units) and the simulator (``fuseflow.sim.costmodel``, seconds) price a fused step
with, so the two can never disagree on the rule.
"""

from __future__ import annotations


def single_model_makespan(p: int, m: int, f: float) -> float:
    """Makespan of one model alone under 1F1B with backward = 2 x forward: ``(m + p - 1) * 3f``.

    It is also that model's critical-path bound: stage p-1 gets its first input after
    (p-1)*f, runs m*(f+2f) of work, and its last gradient needs (p-1)*2f more to reach
    stage 0. Example: p=8, m=8, f=5 gives 225.
    """
    return (m + p - 1) * 3 * f


def arrival_and_tail(device: int, p_c: int, f_a: float, f_c: float) -> tuple[float, float]:
    """Earliest time any work can reach ``device``, and the shortest backward tail after its last task.

    The device holds A's stage ``device`` and C's stage ``p_c - 1 - device % p_c``; the last task of
    a device is always a backward, whose gradient must then reach stage 0 of its model.
    """
    s_a, s_c = device, p_c - 1 - device % p_c
    return min(s_a * f_a, s_c * f_c), min(2 * s_a * f_a, 2 * s_c * f_c)


def fused_pipeline_bound(p_a: int, p_c: int, m_a: int, m_c: int, slot_a: float, slot_c: float) -> float:
    """Makespan lower bound of one fused actor/critic step, with every device equally loaded.

    A slot is one micro-batch's forward and backward on one stage (forward = slot / 3). The
    bound is the largest of each model's 1F1B critical path, a device's work
    ``m_a slot_a + m_c slot_c``, and per device the earliest arrival + that work + the
    shortest backward tail. Example: (8, 8, 32, 32, 15, 6) gives 702, the bound of
    RLHFuse's "8,8,32,32,5,2,...".
    """
    f_a, f_c = slot_a / 3.0, slot_c / 3.0
    work = m_a * slot_a + m_c * slot_c
    best = max(single_model_makespan(p_a, m_a, f_a), single_model_makespan(p_c, m_c, f_c), work)
    for d in range(p_a):
        arrival, tail = arrival_and_tail(d, p_c, f_a, f_c)
        best = max(best, arrival + work + tail)
    return best
