"""Memory stages of the solver: they keep the makespan and lower the peak activation memory.

1. `descent`: the heavier model runs in strict 1F1B and the other one gets a cap per
   device on how many micro-batches it may hold. Each step lowers, on every device at the
   current peak, that cap to one below what the incumbent holds there, then repairs the
   incumbent: a short list-scheduling search from it, and if that fails, CP-SAT with it
   as a hint. Small steps matter: a schedule under the previous caps is nearly one under
   the next, so the repair is quick (on "8,8,32,32,5,2,1.95,1" CP-SAT repaired such
   steps in about 0.03 deterministic seconds, where a cold search at the same caps
   needed a lucky seed), while one big step to a tight target often finds nothing.
2. `exact`: CP-SAT minimises the exact peak (a cumulative constraint per device) from the
   incumbent, on models small enough for it to move (up to 32 micro-batches on 8
   devices). It runs first with the heavier model kept in strict 1F1B, which is where
   it moved fastest ("8,8,16,16,5,2,1.95,1": 19.85 -> 17.85 in 3 CPU seconds, where the
   unconstrained model found nothing in 9), and the descent resumes from what it finds.
3. `flatten`: precedence-constraint posting on the highest peaks: an edge that makes the
   forward reaching the peak wait for an in-flight backward is kept if the makespan holds.
"""

from __future__ import annotations

from fuseflow.schedule.pipeline import cpsat
from fuseflow.schedule.pipeline.graph import CycleError, TaskGraph, device_peaks_of
from fuseflow.schedule.pipeline.state import Search, score_of
from fuseflow.schedule.pipeline.structure import cap_edges, peak_point

# Effort limits, in work units so results do not depend on machine load (state.py).
DESCENT_ROUNDS = 150  # list-scheduling rounds per repair before asking CP-SAT
DESCENT_PATIENCE = 100
# CP-SAT repair limits: successful repairs on "8,8,32,32,5,2,1.95,1" took 0-9 conflicts
# and 0.02 deterministic seconds (about 2 CPU seconds); a failing one was still searching
# after 973 conflicts and 25 CPU seconds (111 conflicts: 14 CPU seconds), so the conflict
# count is the practical limit.
CP_REPAIR_DET = 0.5
CP_REPAIR_CONFLICTS = 30
CP_MEMORY_MAX_TASKS = 1100  # above this the exact-memory CP model rarely improves in time
# Exact-memory CP-SAT calls stop at EXACT_DET deterministic seconds: about 10 CPU seconds
# on 512 tasks ("8,8,16,16,...", where it reached the optimum 15.6 from the descent's
# 19.85 for three seeds out of three; a conflict limit cut one of them off before any
# improvement, so there is none). CP-SAT's deterministic clock under-counts this model,
# so its cost grows faster than the task count; the stage is skipped above
# CP_MEMORY_MAX_TASKS.
EXACT_DET = 2.0
EXACT_FREE_DET = 1.0  # the unstructured model: 20-32 CPU seconds for 2.0 on 768-1024 tasks
FLATTEN_WORK = 2_000_000  # task-rounds for the whole flattening stage
FLATTEN_ROUNDS = 200  # list-scheduling rounds per flattening trial at most


def max_in_flight(g: TaskGraph, start: list[int], device: int, model: str) -> int:
    """Most micro-batches of `model` held at once on `device` in the timed schedule `start`."""
    held = most = 0
    for i in sorted(g.on_device[device], key=start.__getitem__):
        if g.tasks[i].model == model:
            held += -1 if g.tasks[i].backward else 1
            most = max(most, held)
    return most


def respects(g: TaskGraph, start: list[int]) -> bool:
    """Whether `start` satisfies every edge of `g` (including posted structural edges)."""
    return all(start[b] >= start[a] + g.dur[a] for a in range(g.n) for b in g.succ[a])


def _repair(sr: Search, g: TaskGraph, start: list[int], makespan: int) -> list[int] | None:
    """A schedule of `g` within `makespan` near `start` (which may break a few of g's edges)."""
    span, new = sr.heuristic(g, start, makespan, DESCENT_ROUNDS, DESCENT_PATIENCE)
    if span <= makespan:
        return new
    if sr.left() <= 0.1:
        return None
    out = sr.note(cpsat.feasible(g, makespan, sr.effort(CP_REPAIR_DET, CP_REPAIR_CONFLICTS), hint=start, seed=sr.seed))
    return out.start if out.status == "solved" else None


def descent(sr: Search) -> None:
    """Lower the secondary model's per-device caps one step at a time (module docstring)."""
    g0, makespan = sr.g0, sr.best_score[0]
    sec = sr.roles.secondary
    base = sr.roles.primary_caps  # the heavier model in strict 1F1B (structure.py explains why)
    base_edges = sr.primary_edges
    g_base = g0.with_edges(base_edges)
    cur = sr.best_start
    if not respects(g_base, cur):
        found = _repair(sr, g_base, cur, makespan)
        if found is None:
            return
        cur = found
        sr.offer("memory-descent", cur, base_edges)
    caps = dict(base)
    caps.update({(d, sec): (max(1, max_in_flight(g0, cur, d, sec)), False) for d in range(sr.inst.n_devices)})
    while sr.left() > 0.1:
        peaks = device_peaks_of(g0, cur)
        top = max(peaks)
        new = dict(caps)
        for d, peak in enumerate(peaks):
            held = max_in_flight(g0, cur, d, sec)
            if peak >= top - 1e-9 and held > 1:
                new[(d, sec)] = (held - 1, False)
        if new == caps:
            return  # the peak is the strict model's own 1F1B level; nothing left to cap
        edges = cap_edges(g0, new)
        found = _repair(sr, g0.with_edges(edges), cur, makespan)
        if found is None:
            return
        caps, cur = new, found
        sr.offer("memory-descent", cur, edges)


def exact(sr: Search, strict: bool, det: float = EXACT_DET) -> bool:
    """CP-SAT minimising the exact peak from the incumbent (small models only); True if it
    improved. With `strict` the heavier model keeps its strict 1F1B order."""
    if sr.g0.n > CP_MEMORY_MAX_TASKS or sr.left() < 0.5:
        return False
    g0 = sr.g0
    edges = sr.primary_edges if strict else []
    g = g0.with_edges(edges)
    if not respects(g, sr.best_start):
        return False
    out = sr.note(
        cpsat.min_memory(
            g,
            sr.best_score[0],
            sr.effort(det),
            sr.best_start,
            sr.peak,
            sr.seed,
        )
    )
    return out.status == "solved" and sr.offer("memory-exact", out.start, edges)


def minimise(sr: Search) -> None:
    """The memory stages in order: descent and strict exact CP-SAT take turns while either
    improves, then flattening, then a shorter exact CP-SAT call without structure (last,
    because it is the costliest per improvement found)."""
    descent(sr)
    while exact(sr, strict=True):
        before = sr.peak
        descent(sr)
        if sr.peak >= before:
            break
    flatten(sr)
    exact(sr, strict=False, det=EXACT_FREE_DET)


def flatten(sr: Search) -> None:
    """Precedence constraint posting on the highest memory peaks, within FLATTEN_WORK.

    An edge is kept when the schedule found with it keeps the makespan and is no worse
    (plateau moves are allowed: edges only accumulate, so this cannot cycle); the
    incumbent only changes on a strict improvement.
    """
    g0, makespan = sr.g0, sr.best_score[0]
    cur, edges = sr.best_start, sr.best_edges
    cur_score = sr.best_score  # cur is the incumbent
    tried: set[tuple[int, int]] = set()
    stop = sr.rounds_used + sr.rounds_for(FLATTEN_WORK)
    while sr.rounds_used < stop and sr.left() > 0.1:
        peaks = device_peaks_of(g0, cur)
        top = max(peaks)
        accepted = False
        for d in (d for d in range(len(peaks)) if peaks[d] >= top - 1e-9):
            _, fwd, live = peak_point(g0, cur, d)
            # Delay the peak's forward behind an in-flight backward, soonest-ending first.
            for bwd in sorted(live, key=cur.__getitem__):
                if (bwd, fwd) in tried or sr.rounds_used >= stop or sr.left() <= 0.1:
                    continue
                tried.add((bwd, fwd))
                trial = edges + [(bwd, fwd)]
                try:
                    rounds = min(FLATTEN_ROUNDS, stop - sr.rounds_used)
                    span, new = sr.heuristic(g0.with_edges(trial), cur, makespan, rounds, patience=100)
                except CycleError:
                    continue
                score = score_of(span, device_peaks_of(g0, new))
                if span <= makespan and score <= cur_score:
                    sr.offer("memory-flatten", new, trial)
                    edges, cur, cur_score, accepted = trial, new, score, True
                    break
            if accepted:
                break
        if not accepted:
            return
