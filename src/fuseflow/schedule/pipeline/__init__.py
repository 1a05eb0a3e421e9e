"""Fused actor/critic pipeline schedules (RLHFuse intra-stage fusion).

`PipelineInstance` describes the problem, `evaluate` times a per-device order,
`lower_bound` bounds the makespan, `serial_1f1b` / `greedy_fused` are the baselines and
`solve` finds a schedule at (or near) the bound with low activation memory. The
`fuseflow bench pipeline` command (bench.py) runs the published yardstick.
"""

from fuseflow.schedule.pipeline.baselines import greedy_fused, serial_1f1b, serial_1f1b_makespan
from fuseflow.schedule.pipeline.bounds import LowerBound, lower_bound
from fuseflow.schedule.pipeline.problem import (
    Deadlock,
    Evaluation,
    InvalidSchedule,
    PipelineInstance,
    Task,
    check_timed,
    evaluate,
)

__all__ = [
    "Deadlock",
    "Evaluation",
    "InvalidSchedule",
    "LowerBound",
    "PipelineInstance",
    "Task",
    "check_timed",
    "evaluate",
    "greedy_fused",
    "lower_bound",
    "serial_1f1b",
    "serial_1f1b_makespan",
]
