"""Train/rollout mismatch: truncated importance sampling (algorithm.rollout_is=tis) and its metrics.

Exact-math tests against hand-computed values; no vLLM needed (TIS compares the trainer's old
log-probs to whatever behaviour log-probs the rollout reported).
"""

from __future__ import annotations

import math

import pytest
import torch

from fuseflow.algorithms import decoupled_policy_loss, ppo_policy_loss, rollout_mismatch, truncated_is_weight
from fuseflow.config import load_config

F64 = torch.float64


def _case():
    # Ratios to old: 1, 1.5, 0.9. pi_old / pi_behaviour: 2, 1, 4.
    lp = torch.tensor([[0.0, math.log(1.5), math.log(0.9)]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 3, dtype=F64)
    behav = torch.log(torch.tensor([[0.5, 1.0, 0.25]], dtype=F64))
    adv, m = torch.tensor([[1.0, 1.0, -1.0]], dtype=F64), torch.ones(1, 3)
    return lp, old, behav, adv, m


def test_tis_hand_values():
    lp, old, behav, adv, m = _case()
    # PPO tokens (clip 0.2): r=1, A=1 -> -1; r=1.5, A=1 -> clipped -1.2; r=0.9, A=-1 -> 0.9.
    # Weights min(2, 2)=2, min(1, 2)=1, min(4, 2)=2: (-2 - 1.2 + 1.8) / 3.
    loss, met = ppo_policy_loss(lp, old, adv, m, behavior_logprobs=behav, tis_cap=2.0)
    assert loss.item() == pytest.approx((-2.0 - 1.2 + 1.8) / 3, abs=1e-12)
    assert float(met["is_weight_mean"]) == pytest.approx(5 / 3)
    assert float(met["is_cap_frac"]) == pytest.approx(1 / 3)
    loss.backward()
    # The weight is a constant: d/dlp of -w A r = -w A r -> -2/3; the clipped token 0; 2 * 0.9 / 3 = 0.6.
    torch.testing.assert_close(lp.grad, torch.tensor([[-2 / 3, 0.0, 0.6]], dtype=F64))
    # A higher cap lets the third token's weight reach 3: (-2 - 1.2 + 2.7) / 3.
    loss3, met3 = ppo_policy_loss(lp, old, adv, m, behavior_logprobs=behav, tis_cap=3.0)
    assert loss3.item() == pytest.approx((-2.0 - 1.2 + 2.7) / 3, abs=1e-12)
    assert float(met3["is_weight_mean"]) == pytest.approx(2.0)


def test_tis_off_is_plain_ppo_and_masked_tokens_do_not_count():
    lp, old, behav, adv, _ = _case()
    plain, met = ppo_policy_loss(lp, old, adv, torch.ones(1, 3))
    off, _ = ppo_policy_loss(lp, old, adv, torch.ones(1, 3), behavior_logprobs=behav)  # tis_cap=None: off
    assert plain.item() == off.item() and "is_weight_mean" not in met
    # Masking the third token: weights 2, 1 -> (-2 - 1.2) / 2.
    loss, met = ppo_policy_loss(lp, old, adv, torch.tensor([[1.0, 1.0, 0.0]]), behavior_logprobs=behav, tis_cap=2.0)
    assert loss.item() == pytest.approx(-3.2 / 2, abs=1e-12)
    assert float(met["is_cap_frac"]) == 0.0


def test_tis_equals_decoupled_with_old_as_proximal():
    g = torch.Generator().manual_seed(3)
    lp = torch.randn(3, 5, generator=g, dtype=F64) * 0.3
    old, behav = torch.randn(3, 5, generator=g, dtype=F64) * 0.3, torch.randn(3, 5, generator=g, dtype=F64) * 0.3
    adv, m = torch.randn(3, generator=g, dtype=F64), torch.rand(3, 5, generator=g) < 0.8
    a, _ = ppo_policy_loss(lp, old, adv, m, behavior_logprobs=behav, tis_cap=1.5)
    b, _ = decoupled_policy_loss(lp, old, behav, adv, m, is_cap=1.5)
    assert a.item() == pytest.approx(b.item(), abs=1e-12)


def test_truncated_is_weight_errors():
    x, m = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="tis_cap=0"):
        truncated_is_weight(x, x, m, 0, "tis_cap")
    with pytest.raises(ValueError, match="behavior_logprobs is None"):
        ppo_policy_loss(x, x, x, m.float(), tis_cap=2.0)


def test_rollout_mismatch_hand_values():
    behav = torch.tensor([[-1.0, -2.0, -0.5], [0.0, 0.0, 0.0]])
    old = torch.tensor([[-1.05, -2.0, -0.2], [-9.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])  # the 9-nat gap is masked out
    out = rollout_mismatch(behav, old, mask)
    assert out["logprob_diff_max"] == pytest.approx(0.3, abs=1e-6)
    assert out["logprob_diff_mean"] == pytest.approx(0.35 / 4, abs=1e-6)
    assert out["logprob_diff_frac"] == pytest.approx(1 / 4)


def test_rollout_is_config():
    cfg = load_config("default", ["algorithm.rollout_is=tis", "algorithm.rollout_is_cap=3"])
    assert cfg.algorithm.rollout_is == "tis" and cfg.algorithm.rollout_is_cap == 3.0
    assert load_config("default", []).algorithm.rollout_is == "none"  # off by default
    with pytest.raises(ValueError, match="policy_loss=decoupled already does"):
        load_config("default", ["algorithm.rollout_is=tis", "algorithm.policy_loss=decoupled"])
