"""Rollout replicas: continuous-batching decode of variable-length sequences.

A replica (tp x pp devices) runs every admitted sequence one token per round, admits
waiting sequences when KV memory frees up, and reports each sequence's finish time.
Between two admissions or finishes the active set is fixed and the context grows by
one token per sequence per round, so a whole segment of rounds is one vectorised
roofline evaluation: the cost is exact per round yet proportional to the number of
distinct lengths, not to sequences x rounds.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from fuseflow.policy.lengths import assign_by_length

from .costmodel import DecodeModel


@dataclass
class Seq:
    """One sequence in flight: `done` of its `target` response tokens are generated."""

    id: int
    prompt: int
    target: int
    group: int = -1
    done: int = 0
    prefilled: bool = False  # True once its prompt is in this replica's KV cache (or migrated in)


@dataclass
class ReplicaRun:
    """What one replica did: finish times, what is left at `until`, busy time."""

    finishes: list[tuple[int, float]] = field(default_factory=list)  # (seq id, absolute seconds)
    leftover: list[Seq] = field(default_factory=list)
    end: float = 0.0


def run_replica(
    dm: DecodeModel, seqs: list[Seq], start: float = 0.0, cap: int | None = None,
    until: float = math.inf, share_prefix: bool = False,
) -> ReplicaRun:  # fmt: skip
    """Decode `seqs` on one replica from `start`, at most `cap` at a time, stopping at `until`.

    New sequences are prefilled together when admitted; with `share_prefix`, samples of
    the same prompt group admitted together prefill their prompt once (RLHFless).
    Sequences still unfinished at `until` come back in `leftover` with `done` updated.

    Example (two sequences of 1 and 3 tokens):
        run_replica(dm, [Seq(0, 8, 1), Seq(1, 8, 3)]).finishes  ->  [(0, t1), (1, t3)]
    """
    out = ReplicaRun(end=start)
    cap = len(seqs) if cap is None else max(1, cap)
    waiting = deque(seqs)
    # Active sequences live in a heap keyed by the round at which they finish; `rnd`
    # counts rounds since `start` and `ctx` is the total context the active set holds,
    # so each segment costs O(log n) bookkeeping instead of a pass over the batch.
    heap: list[tuple[int, int, Seq]] = []
    admitted: dict[int, tuple[int, int]] = {}  # seq id -> (round admitted, done at admission)
    rnd, ctx, t = 0, 0.0, start

    def admit() -> float:
        nonlocal ctx
        new = []
        while waiting and len(heap) < cap:
            s = waiting.popleft()
            heapq.heappush(heap, (rnd + s.target - s.done, s.id, s))
            admitted[s.id] = (rnd, s.done)
            ctx += s.prompt + s.done
            if not s.prefilled:
                new.append(s)
                s.prefilled = True
        if not new:
            return 0.0
        if share_prefix:
            seen: dict[int, int] = {}
            for s in new:
                seen.setdefault(s.group if s.group >= 0 else -1 - s.id, s.prompt)
            prompts = list(seen.values())
        else:
            prompts = [s.prompt for s in new]
        return dm.prefill_sums(float(sum(prompts)), float(sum(p * (p + 1) for p in prompts)) / 2.0)

    t += admit()
    while heap and t < until:
        n = len(heap)
        k = heap[0][0] - rnd
        seg = dm.segment_seconds(n, ctx + n, k)  # this round's tokens attend ctx + n keys
        if t + seg > until:
            steps = np.cumsum(dm.step_seconds(np.full(k, n, dtype=float), ctx + n + n * np.arange(k, dtype=float)))
            j = int(np.searchsorted(steps, until - t, side="right"))  # rounds completed by `until`
            t += float(steps[j - 1]) if j > 0 else 0.0
            rnd += j
            break
        t += seg
        rnd += k
        ctx += n * k
        while heap and heap[0][0] == rnd:
            _, sid, s = heapq.heappop(heap)
            ctx -= s.prompt + s.target
            s.done = s.target
            out.finishes.append((sid, t))
        t += admit()
    for _, _, s in heap:
        r0, d0 = admitted[s.id]
        s.done = d0 + (rnd - r0)
    out.leftover = sorted((s for _, _, s in heap), key=lambda s: s.id) + list(waiting)
    out.end = t
    return out


def kv_capacity_seqs(dm: DecodeModel, free_bytes_per_gpu: float, prompt: float, max_response: float) -> int:
    """How many sequences a replica can hold if each reserves prompt + max_response KV tokens.

    Reserving the cap (no preemption) is conservative; paged engines admit more and
    preempt on overflow, which this model does not capture.
    """
    per_seq = (prompt + max_response) * dm.kv_bytes_per_token_per_gpu()
    return int(max(0.0, free_bytes_per_gpu) // per_seq) if per_seq > 0 else 1 << 30


def round_robin(seqs: list[Seq], replicas: int) -> list[list[Seq]]:
    """Sample i goes to replica i mod R (what a load-unaware router does)."""
    return [seqs[r::replicas] for r in range(replicas)]


def sorted_chunks(seqs: list[Seq], keys: np.ndarray, replicas: int) -> list[list[Seq]]:
    """Length-aware assignment of sequences to replicas by predicted length ``keys``: the runtime's
    rule (``policy.lengths.assign_by_length``), groups (same prompt) kept on one replica."""
    groups = [s.group if s.group >= 0 else -1 - s.id for s in seqs]
    parts = assign_by_length([float(k) for k in keys], groups, replicas)
    return [[seqs[i] for i in part] for part in parts]


def simulate_generation(
    dm: DecodeModel, assignment: list[list[Seq]], cap: int | None, start: float = 0.0,
    share_prefix: bool = False,
) -> list[ReplicaRun]:  # fmt: skip
    """Run every replica of an assignment to completion (replicas are independent).

    Replicas given identical work (equal lengths, round-robin) are replayed once.
    """
    out, seen = [], {}
    for part in assignment:
        key = tuple((s.prompt, s.target, s.done, s.prefilled, s.group if share_prefix else 0) for s in part)
        if key not in seen:
            seen[key] = (part, run_replica(dm, part, start, cap, share_prefix=share_prefix))
        first, run = seen[key]
        if first is part:
            out.append(run)
            continue
        pos = {s.id: i for i, s in enumerate(first)}
        for s, f in zip(part, first, strict=True):
            s.done, s.prefilled = f.done, f.prefilled
        out.append(ReplicaRun([(part[pos[sid]].id, t) for sid, t in run.finishes],
                              [part[pos[s.id]] for s in run.leftover], run.end))  # fmt: skip
    return out


def generation_layouts(
    model, hw, devices: int, seqs: list[Seq], max_response: float, layouts: list[tuple[int, int]] | None = None,
) -> dict[str, dict]:  # fmt: skip
    """Seconds to generate `seqs` on `devices` devices with each rollout layout, as the plan search prices it.

    A layout is tp x pp devices per replica, `devices // (tp * pp)` replicas fed round-robin;
    pp > 1 is pipelined generation (micro-batches in flight, `DecodeModel`). A layout whose
    weights leave no KV room for one sequence is reported with ``fits: False`` and no seconds:
    that is where pipelined generation pays even when it decodes slower than replicas
    (Pipe-RLHF). Keys are ``"tp{t}.pp{p} x{replicas}"``.
    Example: a 7B fp32 model (28 GB) on 2 `cpu` devices of 16 GB: ``tp1.pp1 x2`` does not fit,
    ``tp1.pp2 x1`` does.
    """
    from .costmodel import DecodeModel
    from .placement import gen_layouts

    prompt = max((s.prompt for s in seqs), default=0)
    out: dict[str, dict] = {}
    for tp, pp in layouts or gen_layouts(model, hw, devices):
        dm = DecodeModel(model, hw, tp, pp)
        replicas = devices // dm.gpus
        cap = kv_capacity_seqs(dm, hw.usable_memory - dm.weight_bytes_per_gpu(), prompt, max_response)
        key = f"tp{tp}.pp{pp} x{replicas}"
        if cap < 1 or replicas < 1:
            out[key] = {"fits": False, "seconds": None, "kv_seqs_per_replica": max(cap, 0)}
            continue
        fresh = [Seq(s.id, s.prompt, s.target, s.group) for s in seqs]
        runs = simulate_generation(dm, round_robin(fresh, replicas), cap)
        out[key] = {"fits": True, "seconds": max(r.end for r in runs), "kv_seqs_per_replica": cap}
    return out
