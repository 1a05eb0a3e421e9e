"""Long-tail migration policy: trigger, target choice, budgets, and the auto threshold (exact cases)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuseflow.policy.migration import (
    Move,
    PendingSample,
    WorkerBudget,
    auto_threshold,
    plan_migration,
    resolve_threshold,
    should_migrate,
    simulate_tail,
    trigger_count,
)


def ps(uid: int, remaining: int = 10, kv: int = 10, length: int = 5) -> PendingSample:
    return PendingSample(uid=uid, length=length, remaining=remaining, kv_tokens=kv)


BIG = WorkerBudget(slots=8, kv_tokens=10_000)


def test_trigger_count_is_floor_of_fraction_and_at_least_one():
    assert trigger_count(64, 0.2) == 12
    assert trigger_count(10, 0.3) == 3
    assert trigger_count(3, 0.1) == 1
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="fraction in"):
            trigger_count(64, bad)


def test_keeps_the_worker_with_more_remaining_work():
    p = {0: [ps(1, remaining=20)], 1: [ps(2, remaining=50)]}
    plan = plan_migration(p, {0: BIG, 1: BIG})
    assert plan.feasible and plan.targets == (1,) and plan.freed == (0,)
    assert plan.moves == (Move(uid=1, src=0, dst=1),)


def test_fewest_targets_then_most_samples_kept_in_place():
    # 6 samples, 4 slots each: two workers are needed; {0, 2} keeps 5 samples in place.
    p = {0: [ps(1), ps(2), ps(3)], 1: [ps(4, kv=40)], 2: [ps(5), ps(6)]}
    budgets = {w: WorkerBudget(slots=4, kv_tokens=1000) for w in range(3)}
    plan = plan_migration(p, budgets)
    assert plan.targets == (0, 2) and plan.freed == (1,)
    # Worker 0 holds 3 x 20 KV, worker 2 holds 2 x 20: the mover goes where more KV is free.
    assert plan.moves == (Move(uid=4, src=1, dst=2),)


def test_kv_budget_overrides_sample_count_preference():
    # Worker 0 holds more samples, but 60 + 50 KV exceeds its 100; worker 1 (KV 200) takes all.
    p = {0: [ps(1, remaining=10, kv=20), ps(2, remaining=10, kv=20)], 1: [ps(3, remaining=10, kv=40)]}
    budgets = {0: WorkerBudget(4, 100), 1: WorkerBudget(4, 200)}
    plan = plan_migration(p, budgets)
    assert plan.targets == (1,) and plan.freed == (0,)
    assert plan.moves == (Move(1, 0, 1), Move(2, 0, 1))


def test_idle_worker_can_be_the_single_target():
    p = {0: [ps(1), ps(2)], 1: [ps(3), ps(4)]}
    budgets = {0: WorkerBudget(2, 1000), 1: WorkerBudget(2, 1000), 2: WorkerBudget(4, 1000)}
    plan = plan_migration(p, budgets)
    assert plan.targets == (2,) and plan.freed == (0, 1) and plan.moved_samples == 4


def test_infeasible_kv_gives_no_moves():
    # Each sample needs 60 KV by the time it finishes; no worker holds both within 100.
    p = {0: [ps(1, remaining=30, kv=30)], 1: [ps(2, remaining=30, kv=30)]}
    plan = plan_migration(p, {0: WorkerBudget(4, 100), 1: WorkerBudget(4, 100)})
    assert not plan.feasible and plan.moves == () and plan.freed == () and "fit" in plan.reason
    assert not should_migrate(p, {0: WorkerBudget(4, 100), 1: WorkerBudget(4, 100)}, batch_size=64, threshold=0.5)


def test_infeasible_slots_even_now():
    p = {0: [ps(1), ps(2), ps(3)], 1: [ps(4)]}
    plan = plan_migration(p, {0: WorkerBudget(2, 1000), 1: WorkerBudget(2, 1000)})
    assert not plan.feasible and plan.targets == (0, 1)


def test_unknown_worker_is_a_clear_error():
    with pytest.raises(ValueError, match=r"workers \[5\]"):
        plan_migration({5: [ps(1)]}, {0: BIG})


def test_should_migrate_respects_the_threshold():
    p = {0: [ps(i) for i in range(6)], 1: [ps(10 + i) for i in range(6)]}
    budgets = {0: WorkerBudget(16, 10_000), 1: WorkerBudget(16, 10_000)}
    assert should_migrate(p, budgets, batch_size=64, threshold=0.2)  # 12 <= floor(12.8)
    assert not should_migrate(p, budgets, batch_size=64, threshold=0.15)  # 12 > 9
    assert not should_migrate({0: [ps(1)]}, budgets, batch_size=64, threshold=0.2)  # one worker: nothing frees


def test_greedy_path_above_the_exact_search_limit():
    budgets = {w: WorkerBudget(4, 10_000) for w in range(24)}
    p = {w: [ps(100 * w + i, remaining=w + 1) for i in range(1 + (w == 7))] for w in range(24)}
    plan = plan_migration(p, budgets)
    assert len(plan.targets) == math.ceil(25 / 4) and 7 in plan.targets and plan.feasible


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), max_size=4), min_size=2, max_size=5),
       st.lists(st.tuples(st.integers(1, 6), st.integers(20, 200)), min_size=5, max_size=5))
def test_plans_respect_budgets_and_place_every_sample_once(workers, caps):
    pending = {w: [ps(10 * w + i, remaining=r, kv=k) for i, (r, k) in enumerate(s)] for w, s in enumerate(workers)}
    budgets = {w: WorkerBudget(*caps[w]) for w in range(5)}
    plan = plan_migration(pending, budgets)
    busy = [w for w, s in pending.items() if s]
    if not plan.feasible or not busy:
        assert plan.moves == ()
        return
    where = {s.uid: w for w, ss in pending.items() for s in ss}
    for mv in plan.moves:
        assert where[mv.uid] == mv.src and mv.src not in plan.targets and mv.dst in plan.targets
        where[mv.uid] = mv.dst
    assert set(where.values()) <= set(plan.targets) and len(plan.targets) < len(busy)
    need = {s.uid: s.kv_need for ss in pending.values() for s in ss}
    for t in plan.targets:
        held = [u for u, w in where.items() if w == t]
        assert len(held) <= budgets[t].slots and sum(need[u] for u in held) <= budgets[t].kv_tokens
    # With KV to spare and no worker over its slots, the fewest targets is the smallest m whose m
    # largest slot counts hold everything.
    roomy = all(b.kv_tokens >= sum(need.values()) for b in budgets.values())
    if roomy and all(len(pending.get(w, [])) <= b.slots for w, b in budgets.items()):
        slots = sorted((b.slots for b in budgets.values()), reverse=True)
        m = next(m for m in range(1, 6) if sum(slots[:m]) >= len(need))
        assert len(plan.targets) == m


def test_simulate_tail_hand_computed():
    # Round robin: worker 0 gets lengths [10, 1], worker 1 [1, 10]. Threshold 0.5: 2 samples left after step 1.
    out = simulate_tail([10, 1, 1, 10], num_workers=2, slots=4, threshold=0.5, per_sample_cost=0.0, resume_cost=1.0)
    assert (out.makespan, out.makespan_migrated, out.freed_worker_time, out.moved) == (10, 11, 9, 1)
    assert out.gain == 9 - 2 * 1
    # With a per-sample cost: each worker's first step costs 2, later ones 1.5 (alone) or 2 (merged).
    out = simulate_tail([10, 1, 1, 10], 2, 4, 0.5, per_sample_cost=0.5, resume_cost=1.0)
    assert (out.makespan, out.makespan_migrated, out.freed_worker_time) == (15.5, 21.0, 13.5)
    assert out.gain == pytest.approx(13.5 - 2 * 5.5)


def test_simulate_tail_no_move_when_nothing_frees():
    out = simulate_tail([1, 1, 1, 10], 2, 4, 0.25)
    assert out.moved == 0 and out.gain == 0.0 and out.makespan == out.makespan_migrated == 10


def test_auto_threshold_picks_the_paying_candidate():
    hist = [[10, 1, 1, 10]]
    assert auto_threshold(hist, 2, 4, candidates=(0.25, 0.5)) == 0.5
    assert auto_threshold([], 2, 4, default=0.3) == 0.3
    # A resume that costs more than the tail it saves: keep the default.
    assert auto_threshold(hist, 2, 4, resume_cost=100.0, candidates=(0.25, 0.5), default=0.2) == 0.2


def test_resolve_threshold():
    assert resolve_threshold(0.3, [], 2, 4) == 0.3
    assert resolve_threshold("auto", [[10, 1, 1, 10]], 2, 4, candidates=(0.25, 0.5)) == 0.5
    with pytest.raises(ValueError, match="'auto'"):
        resolve_threshold("often", [], 2, 4)
    with pytest.raises(ValueError, match="fraction"):
        resolve_threshold(1.2, [], 2, 4)
