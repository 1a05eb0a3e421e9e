"""Registries of advantage estimators and policy losses."""

from __future__ import annotations

import pytest
import torch

import fuseflow.algorithms as algos
from fuseflow.algorithms import (
    ADVANTAGES,
    POLICY_LOSSES,
    call_with_inputs,
    get_advantage,
    get_policy_loss,
    register_advantage,
    register_policy_loss,
)


def test_builtin_names_are_registered_to_the_public_functions():
    for name in ("gae", "grpo", "dr_grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline"):
        assert get_advantage(name) is getattr(algos, name)
    assert get_policy_loss("ppo") is algos.ppo_policy_loss
    assert get_policy_loss("decoupled") is algos.decoupled_policy_loss


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'grpoo'.*dr_grpo, gae, grpo"):
        get_advantage("grpoo")
    with pytest.raises(ValueError, match=r"unknown policy loss .trpo.; known: decoupled, ppo"):
        get_policy_loss("trpo")


def test_register_and_reject_duplicates():
    @register_advantage("test_only_mean_baseline")
    def mean_baseline(scores):
        return scores - scores.mean()

    @register_policy_loss("test_only_reinforce")
    def reinforce(logprobs, advantages, mask):
        return -(logprobs * advantages).mean(), {}

    try:
        assert get_advantage("test_only_mean_baseline") is mean_baseline
        assert get_policy_loss("test_only_reinforce") is reinforce
        register_advantage("test_only_mean_baseline")(mean_baseline)  # same function again is fine
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("test_only_mean_baseline")(lambda scores: scores)
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("ppo")(reinforce)
    finally:
        ADVANTAGES.pop("test_only_mean_baseline", None)
        POLICY_LOSSES.pop("test_only_reinforce", None)


def test_call_with_inputs_picks_what_each_estimator_needs():
    pool = {
        "token_rewards": torch.tensor([[0.0, 1.0]]),
        "values": torch.tensor([[0.5, 0.5]]),
        "mask": torch.ones(1, 2),
        "gamma": 1.0,
        "lam": 1.0,
        "scores": torch.tensor([1.0]),
        "group_ids": torch.tensor([0]),
    }
    adv, ret = call_with_inputs(get_advantage("gae"), **pool)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5]]))
    torch.testing.assert_close(call_with_inputs(get_advantage("grpo"), **pool), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="remax needs input 'baseline_scores'"):
        call_with_inputs(get_advantage("remax"), **pool)
