"""KL estimators and KL coefficient controllers."""

from __future__ import annotations

import math

import pytest
import torch

from fuseflow.algorithms import AdaptiveKLController, FixedKLController, kl_penalty

LOGP = torch.tensor([0.0, -1.0, -2.0, -3.0], dtype=torch.float64)
REF = torch.tensor([-1.0, -1.0, 0.0, 0.0], dtype=torch.float64)  # d = logp - ref = 1, 0, -2, -3


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("k1", [1.0, 0.0, -2.0, -3.0]),
        ("k2", [0.5, 0.0, 2.0, 4.5]),
        ("abs", [1.0, 0.0, 2.0, 3.0]),
        # exp(-d) + d - 1; the last one, e^3 - 4 = 16.09, is clamped to 10.
        ("k3", [math.exp(-1.0), 0.0, math.exp(2.0) - 3.0, 10.0]),
    ],
)
def test_kl_kinds_hand_values(kind, expected):
    torch.testing.assert_close(kl_penalty(LOGP, REF, kind), torch.tensor(expected, dtype=torch.float64))


def test_kl_k3_is_unbiased_estimate_of_true_kl():
    # Samples from pi, k3 averaged, against the exact KL(pi || ref) of two categoricals.
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    exact = float((pi * (pi / ref).log()).sum())
    g = torch.Generator().manual_seed(0)
    idx = torch.multinomial(pi, 200_000, replacement=True, generator=g)
    est = kl_penalty(pi.log()[idx], ref.log()[idx], "k3").mean().item()
    assert est == pytest.approx(exact, abs=3e-3)
    assert kl_penalty(pi.log()[idx], ref.log()[idx], "k1").mean().item() == pytest.approx(exact, abs=5e-3)


def test_kl_is_differentiable_as_a_loss_term():
    lp = LOGP[:3].clone().requires_grad_()
    kl_penalty(lp, REF[:3], "k3").sum().backward()
    # d/dlogp [exp(ref - logp) + logp - ref - 1] = 1 - exp(ref - logp)
    torch.testing.assert_close(lp.grad, 1.0 - torch.exp(REF[:3] - LOGP[:3]))


def test_kl_unknown_kind_lists_kinds():
    with pytest.raises(ValueError, match="k1, k2, k3, abs"):
        kl_penalty(LOGP, REF, "kl")
    with pytest.raises(ValueError, match="shape mismatch"):
        kl_penalty(LOGP, REF[:2], "k1")


def test_adaptive_controller_hand_step():
    c = AdaptiveKLController(0.2, target=4.0, horizon=1000)
    c.update(current_kl=5.0, n_steps=100)  # error .25 -> .2 (clipped)
    assert c.value == pytest.approx(0.2 * (1 + 0.2 * 0.1))
    c.update(current_kl=3.0, n_steps=100)  # error -.25 -> -.2
    assert c.value == pytest.approx(0.2 * 1.02 * 0.98)
    c.update(current_kl=4.4, n_steps=500)  # error .1, not clipped
    assert c.value == pytest.approx(0.2 * 1.02 * 0.98 * 1.05)


def test_adaptive_controller_moves_toward_target():
    # A toy policy whose KL falls as the penalty grows: KL = 2 / beta, so the target
    # KL of 1 is reached at beta = 2. The controller must close the gap steadily.
    c = AdaptiveKLController(0.5, target=1.0, horizon=100)
    gaps = []
    for _ in range(300):
        kl = 2.0 / c.value
        gaps.append(abs(kl - 1.0))
        c.update(kl, n_steps=10)
    assert gaps[-1] < 0.01 < gaps[0]
    assert c.value == pytest.approx(2.0, rel=0.01)


def test_fixed_controller_never_moves_and_errors():
    f = FixedKLController(0.05)
    f.update(100.0, 1000)
    assert f.value == 0.05
    with pytest.raises(ValueError, match="target=0"):
        AdaptiveKLController(0.1, target=0, horizon=10)
    with pytest.raises(ValueError, match="kl_coef=-1"):
        FixedKLController(-1)
