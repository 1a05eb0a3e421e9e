"""Which model the fused-pipeline solver pins to strict 1F1B (primary) and which one it caps
(secondary), derived once in `structure.roles` and used by every solver stage.

All six RLHFuse instances have A primary, so the B-primary cases below are the ones a
wrong or inconsistent derivation would silently get wrong.
"""

from __future__ import annotations

import pytest

from fuseflow.schedule.pipeline import memory
from fuseflow.schedule.pipeline.problem import PipelineInstance, check_timed
from fuseflow.schedule.pipeline.solver import _stage_makespan
from fuseflow.schedule.pipeline.state import Search
from fuseflow.schedule.pipeline.structure import cap_edges, caps_for_target, roles


def _per_device(caps, model: str, n: int) -> list[tuple[int, bool]]:
    return [caps[(d, model)] for d in range(n)]


@pytest.mark.parametrize(
    "spec, primary, primary_caps",
    [
        # 8 * 1.95 = 15.6 > 4 * 2: A is primary; A stage d on device d holds 8 - d in 1F1B.
        ("8,4,32,16,5,4,1.95,2", "A", [8, 7, 6, 5, 4, 3, 2, 1]),
        # 4 * 1 < 4 * 2: B is primary; B runs reversed, stage 3 - d on device d, so 4 - (3 - d).
        ("4,4,4,4,1,1,1,2", "B", [1, 2, 3, 4]),
        # 4 * 1 < 2 * 5: B primary with two replicas; stages on devices 0..3 are 1,0,1,0.
        ("4,2,4,4,1,1,1,5", "B", [1, 2, 1, 2]),
        # 4 * 1 == 2 * 2: a tie goes to A.
        ("4,2,4,4,1,1,1,2", "A", [4, 3, 2, 1]),
        # mem_a = 0: 0 < 1 * 1, so B (one stage per replica, cap 1 everywhere) is primary.
        ("3,1,2,2,1,1,0,1", "B", [1, 1, 1]),
    ],
)
def test_roles_by_hand(spec, primary, primary_caps):
    inst = PipelineInstance.parse(spec)
    rl = roles(inst)
    assert rl.primary == primary
    assert rl.secondary == ("B" if primary == "A" else "A")
    assert sorted(rl.primary_caps) == [(d, primary) for d in range(inst.n_devices)]
    assert _per_device(rl.primary_caps, primary, inst.n_devices) == [(k, True) for k in primary_caps]


def test_primary_caps_are_read_only():
    # Every stage shares the one derivation, so no stage may edit it in place.
    caps = roles(PipelineInstance.parse("4,2,4,4,1,1,1,5")).primary_caps
    with pytest.raises(TypeError):
        caps[(0, "B")] = (9, True)  # type: ignore[index]


def test_caps_for_target_published_example():
    # Device d: A keeps min(8 - d, floor((19.7 - 2) / 1.95) = 9) = 8 - d; B gets
    # floor((19.7 - (8 - d) * 1.95) / 2): 4.1/2, 6.05/2, 8/2, 9.95/2, ... -> 2,3,4,4,5,6,7,8.
    inst = PipelineInstance.parse("8,4,32,16,5,4,1.95,2")
    caps = caps_for_target(inst, roles(inst), 19.7)
    assert _per_device(caps, "A", 8) == [(k, True) for k in (8, 7, 6, 5, 4, 3, 2, 1)]
    assert _per_device(caps, "B", 8) == [(k, False) for k in (2, 3, 4, 4, 5, 6, 7, 8)]


@pytest.mark.parametrize(
    "target, b_caps, a_caps",
    [
        # B (mem 5) keeps min(1F1B cap, floor((12 - 1) / 5) = 2) = 1,2,1,2; A (mem 1) gets
        # floor(12 - 5 * k_B) = 7,2,7,2, clipped to its 4 micro-batches.
        (12.0, [1, 2, 1, 2], [4, 2, 4, 2]),
        # floor((8 - 1) / 5) = 1 on every device, so A gets floor(8 - 5) = 3 everywhere.
        (8.0, [1, 1, 1, 1], [3, 3, 3, 3]),
    ],
)
def test_caps_for_target_with_b_primary(target, b_caps, a_caps):
    inst = PipelineInstance.parse("4,2,4,4,1,1,1,5")
    caps = caps_for_target(inst, roles(inst), target)
    assert set(caps) == {(d, m) for d in range(4) for m in "AB"}
    assert _per_device(caps, "B", 4) == [(k, True) for k in b_caps]
    assert _per_device(caps, "A", 4) == [(k, False) for k in a_caps]


def test_caps_for_target_too_small_is_none():
    # 5.5 leaves floor((5.5 - 1) / 5) = 0 slots for the primary B.
    inst = PipelineInstance.parse("4,2,4,4,1,1,1,5")
    assert caps_for_target(inst, roles(inst), 5.5) is None


def test_descent_keeps_b_primary_strict_and_caps_only_a():
    # B is primary here (4 * 0.5 < 2 * 2): the descent must keep B in strict 1F1B and
    # lower only A's caps. With the roles swapped, B would be capped and A left free.
    inst = PipelineInstance.parse("4,2,6,6,1,2,0.5,2")
    sr = Search(inst, seconds=60, seed=0, progress=None)
    assert (sr.roles.primary, sr.roles.secondary) == ("B", "A")
    _stage_makespan(sr)
    peak = sr.peak
    memory.descent(sr)
    assert sr.best_score[0] == sr.lb and sr.peak < peak  # measured: 6.5 -> 5.5
    g0 = sr.g0
    assert memory.respects(g0.with_edges(cap_edges(g0, sr.roles.primary_caps)), sr.best_start)
    # Every edge the descent posted is B's strict 1F1B or a cap on A, and it posted some on A.
    b_edges = set(cap_edges(g0, sr.roles.primary_caps))
    others = [(a, b) for a, b in sr.best_edges if (a, b) not in b_edges]
    assert others and all(g0.tasks[a].model == g0.tasks[b].model == "A" for a, b in others)
    assert check_timed(inst, g0.times_to_tasks(sr.best_start)) == []
