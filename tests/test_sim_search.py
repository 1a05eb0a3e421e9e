"""Plan enumeration counts and the search's feasibility guarantees."""

from __future__ import annotations

from math import comb

import pytest

from fuseflow.sim.hardware import get_hardware
from fuseflow.sim.modelspec import get_model
from fuseflow.sim.placement import Problem, candidate_layouts, compositions, set_partitions
from fuseflow.sim.plan_config import plan_config_tree
from fuseflow.sim.search import Searcher, search, structure_kind, unit_size
from fuseflow.sim.workload import LengthDist, Workload


@pytest.mark.parametrize("n,bell", [(1, 1), (2, 2), (3, 5), (4, 15), (5, 52)])
def test_set_partitions_are_bell_numbers_and_exact_covers(n, bell):
    items = tuple("abcde"[:n])
    parts = list(set_partitions(items))
    assert len(parts) == bell
    canon = {frozenset(frozenset(b) for b in p) for p in parts}
    assert len(canon) == bell  # no duplicates
    for p in parts:
        assert sorted(x for b in p for x in b) == list(items)


def test_compositions_count():
    assert len(list(compositions(8, 3))) == comb(7, 2)
    assert all(sum(c) == 8 and min(c) >= 1 for c in compositions(8, 3))


def test_layouts_tile_the_devices():
    m, hw = get_model("llama-13b"), get_hardware("H100")
    lays = candidate_layouts(m, hw, 48, trainable=True)
    assert lays and all(lay.gpus == 48 and lay.tp <= 8 and m.heads % lay.tp == 0 for lay in lays)


def test_structure_names():
    assert structure_kind((("actor", "critic", "ref", "reward"),)) == "colocate"
    assert structure_kind((("actor", "ref"), ("critic", "reward"))) == "split"
    assert structure_kind((("actor",), ("critic",), ("ref",), ("reward",))) == "standalone"
    assert structure_kind((("actor", "critic", "ref", "reward"), ("rollout",))) == "colocate+rollout"
    assert unit_size(256, 8) == 8 and unit_size(16, 8) == 1 and unit_size(1024, 8) == 32


def _problem(gpus: int = 16) -> Problem:
    wl = Workload(prompts=64, prompt_len=LengthDist("fixed", max_len=256),
                  response_len=LengthDist("lognormal", max_len=512, median=128, sigma=0.8))  # fmt: skip
    return Problem.build(get_model("llama-7b"), get_hardware("A100"), gpus, wl)


def test_search_returns_feasible_ranked_plans():
    p = _problem()
    searcher = Searcher(p)
    assert len(searcher.structures()) == 2 * 15  # rollout on the actor's devices or on its own
    top, stats = search(p, top=3)
    assert 1 <= len(top) <= 3 and stats["structures"] == 30
    times = [c.best()[1].iteration_seconds for c in top]
    assert times == sorted(times)
    for c in top:
        assert sum(s.gpus for s in c.plan.sets) == 16
        for s in c.plan.sets:
            for role in s.roles:
                if role != "rollout":
                    assert c.plan.layout(role).gpus == s.gpus
        assert max(c.memory_gb.values()) * 1e9 <= p.hw.usable_memory
    tree, notes = plan_config_tree(p, top[0])
    assert tree["trainer"]["mini_batch_size"] % tree["trainer"]["micro_batch_size"] == 0
    used = sum(pool["nodes"] * pool["workers_per_node"] for pool in tree["pools"].values())
    assert used <= 16
    for s in top[0].plan.sets:  # one note per GPU set of the plan, naming its roles and size
        assert f"set {'+'.join(s.roles)}: {s.gpus} GPUs" in "\n".join(notes)


def test_infeasible_problem_is_reported():
    wl = Workload(prompts=8, prompt_len=LengthDist("fixed", max_len=64), response_len=LengthDist("fixed", max_len=64))
    p = Problem.build(get_model("llama-70b"), get_hardware("L40S"), 2, wl)
    with pytest.raises(ValueError, match="no feasible plan"):
        search(p)


def test_plan_search_picks_pipelined_generation_where_a_replica_does_not_fit():
    """A rollout set of 2 devices: with room for the whole model the search may pick replicas; where
    only half the weights fit it picks tp1 x pp2 (pipelined generation), priced with the same decode
    model as `generation_layouts` and to the same seconds (before the fix the search rounded a KV cap of
    32, the whole batch, down to 30 and priced a second decode wave: 71.6 s against 51.7 s)."""
    from dataclasses import replace

    from fuseflow.sim.generation import Seq, generation_layouts

    wl = Workload(prompts=32, prompt_len=LengthDist("fixed", max_len=32), response_len=LengthDist("fixed", max_len=16))
    model, small = get_model("qwen2.5-3b"), replace(get_hardware("cpu"), mem_capacity=10e9)
    tight = Searcher(Problem.build(model, small, 2, wl)).best_set(("rollout",), 2, True)
    assert tight is not None and tight.gen == (1, 2)
    want = generation_layouts(model, small, 2, [Seq(i, 32, 16) for i in range(32)], 16)["tp1.pp2 x1"]["seconds"]
    assert tight.gen_time == pytest.approx(want, rel=1e-9)
    roomy = Searcher(Problem.build(model, get_hardware("cpu"), 2, wl)).best_set(("rollout",), 2, True)
    assert roomy is not None and roomy.gen == (1, 1)  # two replicas fit and decode no slower
