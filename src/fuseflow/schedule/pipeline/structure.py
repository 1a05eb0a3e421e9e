"""Structural edges that bound activation memory, posted into the task graph.

A cap `k` on one model at one device means micro-batch `j + k` may only start its forward
after micro-batch `j`'s backward has ended, so at most `k` of that model's micro-batches
are in flight there. A *strict* cap also makes the backward of `j` wait for the forward of
`j + k - 1`, which pins that model's order on the device to 1F1B with `k` warm-up slots.

Why this shape: measured on the RLHFuse instances, schedules that reach the lower bound
with little memory run the heavier model (A) in plain 1F1B and let the lighter one (B)
fill A's warm-up and drain bubbles. Fixing A's order removes most of the search space, so
the list-scheduling search reaches the bound in seconds instead of minutes (on the
32-micro-batch instances, from its very first latest-start order).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from fuseflow.schedule.pipeline.graph import TaskGraph
from fuseflow.schedule.pipeline.problem import PipelineInstance, Task

Caps = Mapping[tuple[int, str], tuple[int, bool]]  # (device, model) -> (cap, strict)


def stage_on(inst: PipelineInstance, model: str, device: int) -> tuple[int, int]:
    """(replica, stage) of `model` on `device`."""
    if model == "A":
        return 0, device
    return device // inst.p_b, inst.p_b - 1 - device % inst.p_b


@dataclass(frozen=True)
class Roles:
    """Which model the solver pins to strict 1F1B (primary) and which one fills around it
    (secondary, the one whose caps the memory stages lower). Derived once per instance by
    `roles` and passed to every stage, so they cannot disagree.
    """

    primary: str
    # (device, primary) -> (p - s, strict): the primary's own 1F1B warm-up count on the
    # stage it runs there; read-only, copy it with dict(...) to add the secondary's caps.
    primary_caps: Caps

    @property
    def secondary(self) -> str:
        """The other model: the one scheduled around the primary, whose caps the memory stages lower."""
        return "B" if self.primary == "A" else "A"


def roles(inst: PipelineInstance) -> Roles:
    """Primary and secondary model of `inst`, with the primary's strict 1F1B caps.

    The primary is the model whose own 1F1B schedule needs the most memory on one device
    (its stage 0 holds p micro-batches of `mem`); A wins a tie.
    Example: "4,2,4,4,1,1,1,5" has 4*1 < 2*5, so B is primary; its stage on devices 0..3 is
    1,0,1,0 and its caps are 1,2,1,2.
    """
    prim = "A" if inst.p_a * inst.mem_a >= inst.p_b * inst.mem_b else "B"
    p = inst.stages(prim)
    caps = {(d, prim): (p - stage_on(inst, prim, d)[1], True) for d in range(inst.n_devices)}
    return Roles(prim, MappingProxyType(caps))


def cap_edges(g: TaskGraph, caps: Caps) -> list[tuple[int, int]]:
    """Edges enforcing `caps` (see module docstring)."""
    inst, ix = g.inst, g.index
    edges = []
    for (d, model), (k, strict) in caps.items():
        r, s = stage_on(inst, model, d)
        m = inst.micro_batches(model)
        for j in range(m):
            bwd = ix[Task(model, r, j, s, True)]
            if j + k < m:
                edges.append((bwd, ix[Task(model, r, j + k, s, False)]))
            if strict and 0 <= j + k - 1 < m:
                edges.append((ix[Task(model, r, j + k - 1, s, False)], bwd))
    return edges


def caps_for_target(inst: PipelineInstance, rl: Roles, target: float) -> Caps | None:
    """Per-device caps whose worst case, cap_P*mem_P + cap_S*mem_S, stays within `target`.

    The primary model keeps its 1F1B warm-up count (`rl.primary_caps`) where the budget
    allows and is strict; the secondary gets whatever memory is left. Returns None if some
    device cannot hold even one micro-batch of each model.
    Example: "8,4,32,16,5,4,1.95,2" at 19.7 gives A caps 8..1 and B caps 2,3,4,4,5,6,7,8.
    """
    prim, sec = rl.primary, rl.secondary
    mp, ms = inst.mem(prim), inst.mem(sec)
    caps: dict[tuple[int, str], tuple[int, bool]] = {}
    for d in range(inst.n_devices):
        k_p = rl.primary_caps[(d, prim)][0]
        if mp > 0:
            k_p = min(k_p, math.floor((target - ms) / mp + 1e-9))
        k_s = inst.micro_batches(sec) if ms == 0 else math.floor((target - k_p * mp) / ms + 1e-9)
        if k_p < 1 or k_s < 1:
            return None
        caps[(d, prim)] = (k_p, True)
        caps[(d, sec)] = (min(k_s, inst.micro_batches(sec)), False)
    return caps


def peak_point(g: TaskGraph, start: list[int], device: int) -> tuple[float, int, list[int]]:
    """Peak memory on `device`, the forward that reaches it, and the other micro-batches in
    flight at that moment (as the indices of their backward tasks on this device)."""
    held = peak = 0.0
    at = -1
    live: dict[tuple[str, int], int] = {}
    best_live: list[int] = []
    for i in sorted(g.on_device[device], key=start.__getitem__):
        t = g.tasks[i]
        key = (t.model, t.micro_batch)
        held += g.mem_delta[i]
        if t.backward:
            live.pop(key, None)
        else:
            if held > peak + 1e-9:
                peak, at = held, i
                best_live = [g.index[g.tasks[f]._replace(backward=True)] for k, f in live.items()]
            live[key] = i
    return round(peak, 9), at, best_live
