"""Integer task graph and the list-scheduling passes the solver is built on.

Tasks are numbered 0..n-1 so the inner loops work on flat lists. Edges are the problem's
dependencies plus the in-order rule, plus any structural edges the solver posts (memory
caps, 1F1B order, precedences that flatten a memory peak).

`sgs` is a serial schedule-generation scheme with insertion: tasks are taken in priority
order (respecting edges) and each is placed in the earliest gap of its device. Run on the
reversed graph it right-justifies a schedule; alternating the two directions with the
previous pass's times as priorities is forward-backward improvement ("justification"),
which never lengthens a schedule and often shortens it. Both are classic RCPSP tools.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right

from fuseflow.schedule.pipeline.problem import PipelineInstance, Task


class CycleError(ValueError):
    """The posted edges form a cycle, so no schedule satisfies them."""


class TaskGraph:
    """Tasks of one instance as integers, with durations, devices and dependency edges."""

    def __init__(self, inst: PipelineInstance) -> None:
        self.inst = inst
        self.tasks: list[Task] = [t for d in range(inst.n_devices) for t in inst.tasks_on(d)]
        self.index: dict[Task, int] = {t: i for i, t in enumerate(self.tasks)}
        self.n = len(self.tasks)
        self.dur = [inst.duration(t) for t in self.tasks]  # (n,)
        self.dev = [inst.device(t.model, t.replica, t.stage) for t in self.tasks]  # (n,)
        # Activation memory change when the task runs: + for a forward, - for a backward.
        self.mem_delta = [(-1.0 if t.backward else 1.0) * inst.mem(t.model) for t in self.tasks]  # (n,)
        self.on_device: list[list[int]] = [[] for _ in range(inst.n_devices)]
        for i, d in enumerate(self.dev):
            self.on_device[d].append(i)
        self.succ: list[list[int]] = [[] for _ in range(self.n)]
        self.pred: list[list[int]] = [[] for _ in range(self.n)]
        for t in self.tasks:
            for p in inst.predecessors(t):
                self._edge(self.index[p], self.index[t])
            if t.micro_batch > 0:
                self._edge(self.index[t._replace(micro_batch=t.micro_batch - 1)], self.index[t])

    def _edge(self, a: int, b: int) -> None:
        self.succ[a].append(b)
        self.pred[b].append(a)

    def with_edges(self, edges: list[tuple[int, int]]) -> TaskGraph:
        """A copy with extra edges `a -> b` (b starts after a ends); the original is unchanged."""
        g = object.__new__(TaskGraph)
        g.__dict__.update(self.__dict__)
        g.succ = [list(s) for s in self.succ]
        g.pred = [list(p) for p in self.pred]
        for a, b in edges:
            g._edge(a, b)
        return g

    def times_to_tasks(self, start: list[int]) -> dict[Task, int]:
        """Start times keyed by `Task`, from a list indexed like `tasks` (a search's integer starts)."""
        return {t: start[i] for i, t in enumerate(self.tasks)}


def sgs(g: TaskGraph, prio: list[float], reverse: bool = False) -> tuple[list[int], list[int]]:
    """Serial schedule generation with insertion; lower `prio` is scheduled first.

    With `reverse=True` the edges are flipped, which schedules the mirrored problem: its
    times read backwards from its makespan give a right-justified schedule. Raises
    CycleError if the edges contain a cycle.
    """
    n = g.n
    pred = g.succ if reverse else g.pred
    succ = g.pred if reverse else g.succ
    dur, dev = g.dur, g.dev
    indeg = [len(p) for p in pred]
    heap = [(prio[i], i) for i in range(n) if not indeg[i]]
    heapq.heapify(heap)
    start = [0] * n
    end = [0] * n
    n_dev = len(g.on_device)
    starts: list[list[int]] = [[] for _ in range(n_dev)]  # per device, sorted busy starts
    ends: list[list[int]] = [[] for _ in range(n_dev)]  # matching busy ends
    done = 0
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        _, i = pop(heap)
        done += 1
        est = 0
        for p in pred[i]:
            if end[p] > est:
                est = end[p]
        d = dev[i]
        du = dur[i]
        bs, be = starts[d], ends[d]
        k = bisect_right(bs, est)
        if k and be[k - 1] > est:
            est = be[k - 1]
        while k < len(bs) and bs[k] < est + du:
            est = be[k]
            k += 1
        bs.insert(k, est)
        be.insert(k, est + du)
        start[i] = est
        end[i] = est + du
        for s in succ[i]:
            indeg[s] -= 1
            if not indeg[s]:
                push(heap, (prio[s], s))
    if done < n:
        raise CycleError(f"{n - done} tasks sit on a cycle of posted edges")
    return start, end


def justify(g: TaskGraph, start: list[int], end: list[int], rounds: int = 1) -> tuple[list[int], list[int]]:
    """Forward-backward improvement: right-justify, then left-justify, `rounds` times."""
    n = g.n
    for _ in range(rounds):
        rs, re = sgs(g, [-e for e in end], reverse=True)
        span = max(re)
        mirrored = [span - re[i] for i in range(n)]
        start, end = sgs(g, mirrored)
    return start, end


def device_peaks_of(g: TaskGraph, start: list[int]) -> list[float]:
    """Exact per-device peak memory of a timed schedule (see problem.device_peaks)."""
    peaks = []
    for ids in g.on_device:
        held = peak = 0.0
        for i in sorted(ids, key=start.__getitem__):
            held += g.mem_delta[i]
            if held > peak:
                peak = held
        peaks.append(round(peak, 9))
    return peaks
