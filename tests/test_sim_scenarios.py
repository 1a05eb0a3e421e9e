"""Scenario settings that must match the papers' setups (not their results)."""

from __future__ import annotations

import pytest

from fuseflow.sim.hardware import get_hardware
from fuseflow.sim.modelspec import get_model
from fuseflow.sim.placement import Problem
from fuseflow.sim.scenarios import VERL_ROLLOUT_TP, verl_plan
from fuseflow.sim.workload import LengthDist, Workload


def _problem(model: str, gpus: int, algo: str = "ppo") -> Problem:
    wl = Workload(prompts=64, samples_per_prompt=1, algorithm=algo, reward_model=False,
                  prompt_len=LengthDist("fixed", max_len=128), response_len=LengthDist("fixed", max_len=256))  # fmt: skip
    return Problem.build(get_model(model), get_hardware("L40S"), gpus, wl)


def test_verl_plan_is_verls_example_layout():
    plan = verl_plan(_problem("qwen2.5-3b", 16))
    assert plan.kind == "colocate" and plan.gen == (VERL_ROLLOUT_TP, 1) == (2, 1)
    for role in ("actor", "critic", "ref"):
        lay = plan.layout(role)
        assert (lay.tp, lay.pp, lay.dp, lay.zero) == (1, 1, 16, 3)
        assert lay.recompute == (role != "ref")  # gradient checkpointing on trained roles only


def test_verl_plan_rejects_what_verl_cannot_run():
    with pytest.raises(ValueError, match="gen_tp=3"):
        verl_plan(_problem("qwen2.5-3b", 16), gen_tp=3)
    with pytest.raises(ValueError, match="verl layout on 2 x L40S"):
        verl_plan(_problem("qwen2.5-7b", 2))  # 7B actor + critic with Adam: ~240 GB on 96 GB


def test_rollout_logprobs_drops_only_the_actor_forward():
    """RLHFuse's inference stage is reference, critic and reward; verl's adds the actor's forward."""
    from fuseflow.sim.costmodel import Layout
    from fuseflow.sim.engine import simulate
    from fuseflow.sim.placement import DeviceSet, Plan, estimate
    from fuseflow.sim.policies import parse_policy

    def problem(keep: bool) -> Problem:
        wl = Workload(prompts=32, prompt_len=LengthDist("fixed", max_len=128),
                      response_len=LengthDist("fixed", max_len=128), rollout_logprobs=keep)  # fmt: skip
        return Problem.build(get_model("llama-7b"), get_hardware("H100"), 8, wl)

    lay = Layout(tp=8, pp=1, dp=1)
    plan = Plan((DeviceSet(("actor", "critic", "ref", "reward"), 8),), tuple((r, lay) for r in problem(False).roles))
    recompute, keep = problem(False), problem(True)
    costs = estimate(recompute, plan, recompute.workload.step(0))
    assert set(estimate(keep, plan, keep.workload.step(0)).infer) == {"critic", "ref", "reward"}
    assert set(costs.train) == {"actor", "critic"} == set(estimate(keep, plan, keep.workload.step(0)).train)
    a = simulate(recompute, plan, parse_policy("sequential"), 1)
    b = simulate(keep, plan, parse_policy("sequential"), 1)
    actor_fwd = costs.infer["actor"].seconds
    assert actor_fwd > 0
    assert a.gen_plus_inference_seconds - b.gen_plus_inference_seconds == pytest.approx(actor_fwd, rel=1e-9)
    assert a.stages["train"] == pytest.approx(b.stages["train"], rel=1e-12)  # training unchanged
