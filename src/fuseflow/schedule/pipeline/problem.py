"""The fused actor/critic pipeline problem: instance type, task set and schedule evaluator.

Two models train on the same `p_a` devices at once (RLHFuse intra-stage fusion). Model A
has `p_a` stages, stage `s` on device `s`. Model B has `p_b` stages and is replicated
`p_a // p_b` times; replica `r` sits on devices `r*p_b .. (r+1)*p_b - 1` in *reverse*
order, so its stage 0 is on device `(r+1)*p_b - 1`. The two pipelines therefore flow in
opposite directions and each can fill the other's bubbles.

A schedule is, per device, the order of its tasks. `evaluate` turns that order into the
earliest start/end times it allows (the semi-active schedule), and reports invalid orders
and deadlocks as exceptions. Memory depends on the order alone: each device runs one task
at a time, so the activations it holds at any instant are the forwards before that point
minus the backwards before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

MODELS = ("A", "B")


class Task(NamedTuple):
    """One forward or backward of one micro-batch on one stage of one model replica.

    `model` is "A" or "B"; `replica` is always 0 for A; `micro_batch` counts within the
    replica; `backward` is False for a forward.
    """

    model: str
    replica: int
    micro_batch: int
    stage: int
    backward: bool

    def label(self) -> str:
        """Short human label, e.g. `A F3 s2` or `B1 B0 s1` (model+replica, phase+mb, stage)."""
        rep = "" if self.model == "A" else str(self.replica)
        return f"{self.model}{rep} {'B' if self.backward else 'F'}{self.micro_batch} s{self.stage}"


class InvalidSchedule(ValueError):
    """A per-device order that is not a schedule of the instance (wrong task set or order)."""


class Deadlock(InvalidSchedule):
    """Every device waits on a task that another device will only run later."""


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} is invalid: it must be a positive integer")
    return value


@dataclass(frozen=True)
class PipelineInstance:
    """One fused-pipeline problem, written `pA,pB,mA,mB,fA,fB,memA,memB` on the CLI.

    Times are integer units (a backward takes `2*f`); memories are per held micro-batch.
    Example: `PipelineInstance.parse("8,4,32,16,5,4,1.95,2")` is RLHFuse's largest
    8-device instance (A on 8 stages, B on 4 stages replicated twice).
    """

    p_a: int
    p_b: int
    m_a: int
    m_b: int
    f_a: int
    f_b: int
    mem_a: float
    mem_b: float

    def __post_init__(self) -> None:
        for name in ("p_a", "p_b", "m_a", "m_b", "f_a", "f_b"):
            _positive_int(name, getattr(self, name))
        if self.p_a % self.p_b:
            raise ValueError(f"p_b={self.p_b} is invalid: it must divide p_a={self.p_a}")
        for name in ("mem_a", "mem_b"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name}={value!r} is invalid: it must be a number >= 0")

    @classmethod
    def parse(cls, text: str) -> PipelineInstance:
        """Parse `pA,pB,mA,mB,fA,fB,memA,memB`; raises ValueError naming the bad field."""
        parts = [p.strip() for p in text.split(",")]
        names = ("pA", "pB", "mA", "mB", "fA", "fB", "memA", "memB")
        if len(parts) != len(names):
            raise ValueError(
                f"instance {text!r} has {len(parts)} fields; expected 8: pA,pB,mA,mB,fA,fB,memA,memB"
            )
        values: list[int | float] = []
        for name, part in zip(names, parts, strict=True):
            try:
                values.append(int(part) if not name.startswith("mem") else float(part))
            except ValueError:
                kind = "a number" if name.startswith("mem") else "an integer"
                raise ValueError(f"instance field {name}={part!r} is not {kind}") from None
        try:
            return cls(*values)  # type: ignore[arg-type]
        except ValueError as err:
            # Re-word the dataclass field names into the CLI spelling the user typed.
            msg = str(err)
            for py, cli in zip(("p_a", "p_b", "m_a", "m_b", "f_a", "f_b", "mem_a", "mem_b"), names, strict=True):
                msg = msg.replace(py + "=", cli + "=")
            raise ValueError(f"instance {text!r}: {msg}") from None

    def spec(self) -> str:
        """The CLI spelling, inverse of `parse`."""
        return f"{self.p_a},{self.p_b},{self.m_a},{self.m_b},{self.f_a},{self.f_b},{self.mem_a:g},{self.mem_b:g}"

    @property
    def n_devices(self) -> int:
        """Devices of the instance: `p_a` (A has a stage on each; B's replicas tile the same devices)."""
        return self.p_a

    @property
    def replicas_b(self) -> int:
        """Number of copies of model B, `p_a // p_b`, each on its own `p_b` consecutive devices."""
        return self.p_a // self.p_b

    def stages(self, model: str) -> int:
        """Pipeline stages of `model`: `p_a` for "A", `p_b` for "B" (per replica)."""
        return self.p_a if model == "A" else self.p_b

    def micro_batches(self, model: str) -> int:
        """Micro-batches of `model` per step: `m_a` for "A", `m_b` for each replica of "B"."""
        return self.m_a if model == "A" else self.m_b

    def forward_time(self, model: str) -> int:
        """Duration of one forward of `model` on one stage, in integer time units (a backward takes 2x)."""
        return self.f_a if model == "A" else self.f_b

    def mem(self, model: str) -> float:
        """Activation memory one micro-batch of `model` holds on a device from its forward until its
        backward ends."""
        return self.mem_a if model == "A" else self.mem_b

    def device(self, model: str, replica: int, stage: int) -> int:
        """Device of a stage: A stage s -> s; B replica r stage s -> (r+1)*p_b - 1 - s."""
        if model == "A":
            return stage
        return (replica + 1) * self.p_b - 1 - stage

    def duration(self, task: Task) -> int:
        """Duration of `task` in integer time units: `f` for a forward, `2*f` for a backward."""
        f = self.forward_time(task.model)
        return 2 * f if task.backward else f

    def tasks_on(self, device: int) -> list[Task]:
        """All tasks of one device, A first then B, forwards then backwards, by micro-batch."""
        out = [Task("A", 0, j, device, bw) for bw in (False, True) for j in range(self.m_a)]
        r, pos = divmod(device, self.p_b)
        s = self.p_b - 1 - pos
        out += [Task("B", r, j, s, bw) for bw in (False, True) for j in range(self.m_b)]
        return out

    def predecessors(self, task: Task) -> list[Task]:
        """Cross-stage dependencies of `task` (same-device order is the schedule's job)."""
        model, r, j, s, bw = task
        last = self.stages(model) - 1
        if not bw:
            return [Task(model, r, j, s - 1, False)] if s > 0 else []
        if s == last:
            return [Task(model, r, j, s, False)]
        return [Task(model, r, j, s + 1, True)]

    def device_work(self, device: int) -> int:
        """Busy time of a device: all its forwards and backwards (equal on every device)."""
        del device  # every device holds one stage of A and one stage of one B replica
        return 3 * (self.m_a * self.f_a + self.m_b * self.f_b)


Order = list[list[Task]]  # per device, the tasks in the order it runs them


@dataclass
class Evaluation:
    """Times and memory of a valid per-device order (semi-active: each task starts ASAP)."""

    start: dict[Task, int]
    end: dict[Task, int]
    makespan: int
    device_peaks: list[float]  # (N,) peak activation memory per device

    @property
    def peak_memory(self) -> float:
        """Largest per-device peak of activation memory (the objective's second term)."""
        return max(self.device_peaks)

    @property
    def sum_of_peaks(self) -> float:
        """Sum of the per-device peaks (the objective's last term, breaking ties on the peak)."""
        return sum(self.device_peaks)

    def score(self) -> tuple[int, float, float]:
        """Lexicographic objective: makespan, then peak memory, then sum of per-device peaks."""
        return (self.makespan, round(self.peak_memory, 9), round(self.sum_of_peaks, 9))


def check_order(inst: PipelineInstance, order: Order) -> None:
    """Raise InvalidSchedule unless `order` holds each device's tasks exactly once, with each
    model's forwards and backwards in micro-batch order (the problem's in-order rule)."""
    if len(order) != inst.n_devices:
        raise InvalidSchedule(f"order has {len(order)} devices; the instance has {inst.n_devices}")
    for d, seq in enumerate(order):
        expected = set(inst.tasks_on(d))
        seen: set[Task] = set()
        next_mb: dict[tuple[str, bool], int] = {}
        for t in seq:
            if t not in expected:
                raise InvalidSchedule(f"device {d}: task {t.label()} does not belong on this device")
            if t in seen:
                raise InvalidSchedule(f"device {d}: task {t.label()} appears twice")
            seen.add(t)
            key = (t.model, t.backward)
            want = next_mb.get(key, 0)
            if t.micro_batch != want:
                raise InvalidSchedule(
                    f"device {d}: {t.label()} runs before micro-batch {want} of the same model and phase"
                )
            next_mb[key] = want + 1
        if len(seen) != len(expected):
            missing = sorted(expected - seen)[0]
            raise InvalidSchedule(f"device {d}: {len(expected) - len(seen)} tasks missing, e.g. {missing.label()}")


def device_peaks(inst: PipelineInstance, order: Order) -> list[float]:
    """Peak activation memory per device, from the order alone.

    A forward adds its model's `mem` until its backward ends; since a device is serial,
    the running sum after each task is the memory held until the next task starts.
    """
    peaks = []
    for seq in order:
        held = peak = 0.0
        for t in seq:
            held += -inst.mem(t.model) if t.backward else inst.mem(t.model)
            # The backward holds its activations until it ends, so only forwards raise the peak.
            peak = max(peak, held)
        peaks.append(round(peak, 9))
    return peaks


def evaluate(inst: PipelineInstance, order: Order) -> Evaluation:
    """Earliest start/end times for a per-device order; raises InvalidSchedule or Deadlock.

    Each device runs its list front to back; a task starts when the device is free and its
    cross-stage predecessor has ended. If no device can start its next task, the remaining
    tasks wait on each other in a cycle: that is a deadlock.
    """
    check_order(inst, order)
    end: dict[Task, int] = {}
    start: dict[Task, int] = {}
    pos = [0] * inst.n_devices
    free = [0] * inst.n_devices
    remaining = sum(len(s) for s in order)
    while remaining:
        progressed = False
        for d, seq in enumerate(order):
            # Run as far down this device's list as dependencies allow.
            while pos[d] < len(seq):
                t = seq[pos[d]]
                preds = inst.predecessors(t)
                if any(p not in end for p in preds):
                    break
                s = max([free[d]] + [end[p] for p in preds])
                start[t] = s
                end[t] = free[d] = s + inst.duration(t)
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = [
                f"device {d} waits at {order[d][pos[d]].label()}" for d in range(len(order)) if pos[d] < len(order[d])
            ]
            raise Deadlock("deadlock: " + "; ".join(blocked[:4]) + ("; ..." if len(blocked) > 4 else ""))
    return Evaluation(start, end, max(end.values()), device_peaks(inst, order))


def check_timed(inst: PipelineInstance, start: dict[Task, int]) -> list[str]:
    """Independent validity check of timed tasks; returns the list of violations (empty = valid).

    Does not trust the evaluator: it re-derives every constraint from the problem statement
    (task set, dependencies, one task at a time per device, micro-batch order per model).
    """
    problems: list[str] = []
    expected = {t for d in range(inst.n_devices) for t in inst.tasks_on(d)}
    if set(start) != expected:
        problems.append(f"task set differs: {len(expected - set(start))} missing, {len(set(start) - expected)} extra")
        return problems
    end = {t: s + inst.duration(t) for t, s in start.items()}
    for t, s in start.items():
        if s < 0:
            problems.append(f"{t.label()} starts at {s} < 0")
        for p in inst.predecessors(t):
            if end[p] > s:
                problems.append(f"{t.label()} starts at {s} before its predecessor {p.label()} ends at {end[p]}")
        if t.micro_batch > 0:
            prev = t._replace(micro_batch=t.micro_batch - 1)
            if start[prev] >= s:
                problems.append(f"{t.label()} starts before micro-batch {prev.micro_batch} of the same phase")
    for d in range(inst.n_devices):
        seq = sorted(inst.tasks_on(d), key=lambda t: start[t])
        for a, b in zip(seq, seq[1:], strict=False):
            if end[a] > start[b]:
                problems.append(f"device {d}: {a.label()} and {b.label()} overlap")
    return problems


def order_from_times(inst: PipelineInstance, start: dict[Task, int]) -> Order:
    """Per-device order implied by start times (ties broken by task, which never matters
    for a valid schedule since tasks on one device cannot share a start)."""
    return [sorted(inst.tasks_on(d), key=lambda t: (start[t], t)) for d in range(inst.n_devices)]
