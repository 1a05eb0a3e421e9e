"""The policy package's decisions against hand-computed cases and naive references."""

from __future__ import annotations

import itertools

import pytest

from fuseflow.policy.elastic import (
    DecodeCost,
    ReplicaOption,
    cheapest_within,
    fit_decode_cost,
    replica_seconds,
)
from fuseflow.policy.lengths import LengthPredictor, assign_by_length


def test_predictor_uses_each_prompts_window_and_falls_back_to_the_last_step():
    p = LengthPredictor(window=2, default=16.0)
    assert p.predict(["a", "b"]) == [16.0, 16.0]  # nothing seen yet
    p.observe(["a", "a", "b", "b"], [2, 4, 10, 10])  # a: 3, b: 10; step mean 6.5
    p.observe(["a", "a"], [7, 7])  # a: 7; step mean 7
    p.observe(["a", "a"], [9, 11])  # a: 10 (the window drops the 3); step mean 10
    assert p.predict(["a", "b", "new"]) == [8.5, 10.0, 10.0]
    with pytest.raises(ValueError, match="window must be >= 1"):
        LengthPredictor(window=0, default=1.0)
    with pytest.raises(ValueError, match="2 keys for 1 lengths"):
        p.observe(["a", "b"], [1])


def test_assignment_keeps_groups_together_longest_first_in_token_shares():
    pred = [3, 3, 20, 20, 8, 8, 1, 1]
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    # Groups by longest prediction: 1 (40 tokens), 2 (16), 0 (6), 3 (2); total 64, 32 per replica.
    assert assign_by_length(pred, groups, 2) == [[2, 3], [4, 5, 0, 1, 6, 7]]
    assert assign_by_length(pred, groups, 1) == [[2, 3, 4, 5, 0, 1, 6, 7]]
    # More replicas than groups: the last ones get nothing; every item is assigned exactly once.
    out = assign_by_length(pred, groups, 6)
    assert sorted(i for part in out for i in part) == list(range(8)) and out[-1] == []
    for part in out:  # no group is split
        assert len({groups[i] for i in part}) * 2 == len(part)


def test_cheapest_within_matches_brute_force():
    opts = [ReplicaOption(w, s, c) for w, s, c in ((1, 9.0, 9.0), (2, 5.0, 10.0), (3, 4.0, 12.0), (4, 3.8, 15.2))]
    for budget, rest in itertools.product((0.0, 0.05, 0.3, 1.0), (0.0, 2.0, 20.0)):
        fastest = min(o.seconds for o in opts)
        ok = [o for o in opts if o.seconds + rest <= (1 + budget) * (fastest + rest) + 1e-9]
        want = min(ok, key=lambda o: (o.cost, o.seconds, o.replicas))
        assert cheapest_within(opts, budget, rest) == want, (budget, rest)
    assert cheapest_within(opts, 0.0).replicas == 4
    with pytest.raises(ValueError, match="no replica count"):
        cheapest_within([], 0.1)


def test_fit_decode_cost_recovers_a_line_and_keeps_the_prior_ratio_without_spread():
    rows = [1, 4, 8, 16, 32]
    cost = fit_decode_cost(rows, [0.002 + 0.0003 * r for r in rows], DecodeCost(1.0, 1.0))
    assert cost.base == pytest.approx(0.002) and cost.per_row == pytest.approx(0.0003)
    same = fit_decode_cost([4, 4], [0.6, 0.6], DecodeCost(1.0, 0.5))  # one row count: scale the prior
    assert same.step_seconds(4) == pytest.approx(0.6) and same.per_row / same.base == pytest.approx(0.5)
    assert fit_decode_cost([], [], DecodeCost(2.0, 0.0)) == DecodeCost(2.0, 0.0)


def _naive_replica_seconds(lengths, slots, cost):
    """Step-by-step continuous batching: longest waiting admitted when a slot frees."""
    waiting = sorted(lengths, reverse=True)
    running: list[int] = []
    total = 0.0
    while waiting or running:
        while waiting and len(running) < slots:
            running.append(waiting.pop(0))
        total += cost.step_seconds(len(running))
        running = [n - 1 for n in running if n > 1]
    return total


@pytest.mark.parametrize("slots", [1, 2, 3, 8])
def test_replica_seconds_equals_a_step_by_step_replay(slots):
    cost = DecodeCost(0.5, 0.25)
    for lengths in ([5], [3, 1], [7, 7, 2, 9, 1, 4], [1] * 10, [12, 3, 3, 3, 3]):
        assert replica_seconds(lengths, slots, cost) == pytest.approx(_naive_replica_seconds(lengths, slots, cost))
    assert replica_seconds([], 4, cost) == 0.0
