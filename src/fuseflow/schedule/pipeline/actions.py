"""Per-device action lists that the pipeline executor runs, and their validation.

An action is the solver's `Task` (model, replica, micro-batch, stage, forward/backward),
so 1F1B, serial 1F1B and the solver's fused schedules are all the same kind of input: a
`Plan` holding, per device, the actions in the order that device runs them. Model "A"
(the actor) has stage s on device s; model "B" (the critic) runs in the opposite
direction, stage s on device p - 1 - s, as in `PipelineInstance.device` with one replica.

`validate` simulates the plan's dependencies before anything runs, so an invalid or
deadlocking list is one line naming the device and the action instead of a hang across
processes. `simulate` times a valid plan from per-(model, stage, phase) durations: the
executor's makespan prediction.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from fuseflow.schedule.pipeline.baselines import one_f_one_b
from fuseflow.schedule.pipeline.problem import PipelineInstance, Task, order_from_times

MODELS = ("A", "B")


class InvalidPlan(ValueError):
    """An action list that cannot run: wrong device, duplicate or missing action, or a deadlock."""


@dataclass(frozen=True)
class Plan:
    """What each of `n_devices` stage processes runs, in order.

    `micro_batches` maps each model in the plan ("A", "B" or both) to its micro-batch
    count; every model has `n_devices` stages (one per device).
    Example: `one_f_one_b_plan(2, {"A": 4})` is plain 1F1B of one model on 2 devices.
    """

    order: tuple[tuple[Task, ...], ...]  # (n_devices,) each device's actions in run order
    micro_batches: Mapping[str, int]

    @property
    def n_devices(self) -> int:
        """Number of devices, each with one stage process and action list; every model has as many stages."""
        return len(self.order)

    def device(self, model: str, stage: int) -> int:
        """Device of a model's stage: A stage s on device s, B stage s on device p - 1 - s."""
        return stage if model == "A" else self.n_devices - 1 - stage

    def stage_on(self, model: str, device: int) -> int:
        """Stage of `model` that runs on `device`, the inverse of `device`: A stage d, B stage p - 1 - d."""
        return device if model == "A" else self.n_devices - 1 - device

    def predecessor(self, t: Task) -> Task | None:
        """The action of another (or the same) stage that `t` needs: the previous stage's
        forward, the next stage's backward, or on the last stage its own forward."""
        last = self.n_devices - 1
        if not t.backward:
            return t._replace(stage=t.stage - 1) if t.stage > 0 else None
        if t.stage == last:
            return t._replace(backward=False)
        return t._replace(stage=t.stage + 1)

    def labels(self) -> list[list[str]]:
        """Each device's actions as `Task.label` strings in run order, e.g. `A F3 s2` (for reports)."""
        return [[t.label() for t in seq] for seq in self.order]


def _stage_sequence(model: str, p: int, m: int, stage: int) -> list[Task]:
    return [Task(model, 0, j, stage, bw) for bw, j in one_f_one_b(p, m, stage)]


def one_f_one_b_plan(p: int, micro_batches: Mapping[str, int]) -> Plan:
    """Each model in its own 1F1B order, models one after the other on every device (the
    serial-1F1B baseline when both are given; plain 1F1B when one is).

    No barrier separates the models: a device starts B's warm-up as soon as it has finished
    A's work, which is what the executor does without an explicit flush.
    """
    order = []
    for d in range(p):
        seq: list[Task] = []
        for model in MODELS:
            if model in micro_batches:
                stage = d if model == "A" else p - 1 - d
                seq += _stage_sequence(model, p, micro_batches[model], stage)
        order.append(tuple(seq))
    return Plan(tuple(order), dict(micro_batches))


def plan_from_schedule(inst: PipelineInstance, start: Mapping[Task, int]) -> Plan:
    """The per-device order of a solved fused schedule (`solve(...).start`) as a Plan.

    Only instances with one critic replica (p_a == p_b) map onto one stage per process of
    each model; replicated critics would need a data-parallel gradient reduction as well.
    """
    if inst.p_a != inst.p_b:
        raise ValueError(f"instance {inst.spec()}: the executor runs p_a == p_b only (one critic replica)")
    order = order_from_times(inst, dict(start))
    return Plan(tuple(tuple(seq) for seq in order), {"A": inst.m_a, "B": inst.m_b})


@functools.lru_cache(maxsize=64)
def solved_plan(inst: PipelineInstance, seconds: float = 10.0, memory_cap: float | None = None, seed: int = 0) -> Plan:
    """The solver's fused schedule for `inst` as a Plan, cached per instance (a training
    run meets the same micro-batch counts and stage times step after step). `seconds` is
    the solver's time limit; `memory_cap` its hard cap on peak memory (memcap.py)."""
    from fuseflow.schedule.pipeline.solver import solve  # OR-Tools: imported only when solving

    return plan_from_schedule(inst, solve(inst, seconds=seconds, memory_cap=memory_cap, seed=seed).start)


def validate(plan: Plan) -> None:
    """Raise InvalidPlan (one line naming the device and action) unless `plan` can run.

    Checks that every action sits on its stage's device, appears once, that every device
    holds all of its stages' actions, and simulates the dependencies: if at some point no
    device can run its next action, the plan would deadlock across processes.
    """
    p = plan.n_devices
    if p < 1:
        raise InvalidPlan("plan has no devices")
    for model, m in plan.micro_batches.items():
        if model not in MODELS or m < 1:
            raise InvalidPlan(f"plan: model {model!r} with {m} micro-batches (models are 'A'/'B', counts >= 1)")
    for d, seq in enumerate(plan.order):
        seen: set[Task] = set()
        for t in seq:
            if t.model not in plan.micro_batches or not 0 <= t.micro_batch < plan.micro_batches[t.model]:
                raise InvalidPlan(f"device {d}: action {t.label()} is not part of the plan's models/micro-batches")
            if not 0 <= t.stage < p or plan.device(t.model, t.stage) != d or t.replica != 0:
                raise InvalidPlan(f"device {d}: action {t.label()} belongs on device {plan.device(t.model, t.stage)}")
            if t in seen:
                raise InvalidPlan(f"device {d}: action {t.label()} appears twice")
            seen.add(t)
        for model, m in plan.micro_batches.items():
            s = plan.stage_on(model, d)
            for j in range(m):
                for bw in (False, True):
                    if Task(model, 0, j, s, bw) not in seen:
                        raise InvalidPlan(f"device {d}: action {Task(model, 0, j, s, bw).label()} is missing")
    simulate(plan, {})


def simulate(plan: Plan, durations: Mapping[tuple[str, int, bool], float]) -> tuple[float, dict[Task, float]]:
    """Earliest-start times of a plan: (makespan, start of each action).

    `durations[(model, stage, backward)]` is the time of one action (0 when absent, which
    turns this into a pure dependency check). Raises InvalidPlan on a deadlock, naming the
    first stuck device, its next action and what that action waits for.
    """
    end: dict[Task, float] = {}
    start: dict[Task, float] = {}
    pos = [0] * plan.n_devices
    free = [0.0] * plan.n_devices
    left = sum(map(len, plan.order))
    while left:
        moved = False
        for d, seq in enumerate(plan.order):
            while pos[d] < len(seq):
                t = seq[pos[d]]
                pred = plan.predecessor(t)
                if pred is not None and pred not in end:
                    break
                s = max(free[d], end[pred] if pred is not None else 0.0)
                start[t] = s
                end[t] = free[d] = s + durations.get((t.model, t.stage, t.backward), 0.0)
                pos[d] += 1
                left -= 1
                moved = True
        if not moved:
            stuck = [d for d in range(plan.n_devices) if pos[d] < len(plan.order[d])]
            # Name a device that waits on itself if there is one: that is the root cause.
            own = [d for d in stuck if plan.device(*_where(plan.predecessor(plan.order[d][pos[d]]))) == d]
            d = (own or stuck)[0]
            t = plan.order[d][pos[d]]
            pred = plan.predecessor(t)
            assert pred is not None
            raise InvalidPlan(
                f"deadlock: device {d} waits at action {t.label()} for {pred.label()} on device "
                f"{plan.device(pred.model, pred.stage)}, which never runs before it"
            )
    return (max(end.values()) if end else 0.0), start


def _where(t: Task | None) -> tuple[str, int]:
    assert t is not None  # a stuck action always waits on another one
    return t.model, t.stage
