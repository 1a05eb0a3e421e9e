"""Exact-math tests for the policy and value losses."""

from __future__ import annotations

import math

import pytest
import torch

from fuseflow.algorithms import decoupled_policy_loss, ppo_policy_loss, value_loss

F64 = torch.float64


def logs(*ratios):
    return torch.tensor([list(map(math.log, ratios))], dtype=F64, requires_grad=True)


def naive_ppo_tokens(logp, old, adv, mask, cl, ch, dual):
    """Per-token loop: (list of per-token losses, clip count) over masked-in tokens."""
    out, clipped = [], 0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            a = float(adv[i]) if adv.dim() == 1 else float(adv[i, t])
            r = math.exp(float(logp[i, t]) - float(old[i, t]))
            l1, l2 = -a * r, -a * min(max(r, 1 - cl), 1 + ch)
            loss = max(l1, l2)
            clipped += l2 > l1
            if dual is not None and a < 0:
                loss = min(loss, -a * dual)
            out.append(loss)
    return out, clipped


def test_ppo_hand_values_and_metrics():
    # ratios 1.5, 0.5, 1.1, 0.7 with A = 1, 1, -1, -1, clip .2:
    # token losses -1.2 (clipped), -0.5, 1.1, 0.8 (clipped) -> mean 0.05.
    lp = logs(1.5, 0.5, 1.1, 0.7)
    loss, met = ppo_policy_loss(lp, torch.zeros(1, 4, dtype=F64), torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=F64),
                                torch.ones(1, 4))
    assert loss.item() == pytest.approx(0.05)
    assert float(met["clip_frac"]) == pytest.approx(0.5)
    assert float(met["ratio_mean"]) == pytest.approx(0.95)
    k3 = [r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 0.7)]
    assert float(met["approx_kl"]) == pytest.approx(sum(k3) / 4)
    assert float(met["dual_clip_frac"]) == 0.0
    loss.backward()
    # d/dlogp of -A*r/4 is -A*r/4 on unclipped tokens, 0 on clipped ones.
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.5 / 4, 1.1 / 4, 0.0]], dtype=F64))


def test_ppo_asymmetric_clip_hand_values():
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=F64).unsqueeze(0)
    lp = logs(1.25, 1.3, 0.75)
    old, m = torch.zeros(1, 3, dtype=F64), torch.ones(1, 3)
    # clip-higher .28: 1.25 stays (-1.25), 1.3 -> 1.28, 0.75 -> 0.8 (A<0): mean -1.73/3.
    asym, met = ppo_policy_loss(lp, old, adv, m, clip_low=0.2, clip_high=0.28)
    assert asym.item() == pytest.approx(-1.73 / 3)
    assert float(met["clip_frac"]) == pytest.approx(2 / 3)
    sym, _ = ppo_policy_loss(lp, old, adv, m)  # 1.25 now clipped to 1.2: -1.6/3
    assert sym.item() == pytest.approx(-1.6 / 3)
    asym.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.25 / 3, 0.0, 0.0]], dtype=F64))


def test_ppo_dual_clip_hand_values():
    # (A, r): (-1, 5) -> max(5, 1.2)=5 capped at 3; (-2, 2) -> 4 under cap 6; (1, 5) -> -1.2.
    lp = logs(5.0, 2.0, 5.0)
    adv = torch.tensor([[-1.0, -2.0, 1.0]], dtype=F64)
    old, m = torch.zeros(1, 3, dtype=F64), torch.ones(1, 3)
    loss, met = ppo_policy_loss(lp, old, adv, m, dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 + 4.0 - 1.2) / 3)
    assert float(met["dual_clip_frac"]) == pytest.approx(1 / 3)
    plain, _ = ppo_policy_loss(lp, old, adv, m)
    assert plain.item() == pytest.approx((5.0 + 4.0 - 1.2) / 3)
    loss.backward()
    # Capped token has no gradient; token 2 is -A*r = 4 -> grad 4/3; token 3 clipped.
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 4.0 / 3, 0.0]], dtype=F64))


def test_ppo_sequence_advantages_broadcast():
    g = torch.Generator().manual_seed(0)
    lp, old = torch.randn(3, 4, generator=g, dtype=F64) * 0.3, torch.randn(3, 4, generator=g, dtype=F64) * 0.3
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    m = torch.ones(3, 4)
    a, _ = ppo_policy_loss(lp, old, adv, m)
    b, _ = ppo_policy_loss(lp, old, adv.unsqueeze(1).expand(3, 4), m)
    assert a.item() == b.item()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dual", [None, 2.5])
def test_ppo_matches_naive_loop(seed, dual):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(4, 7, generator=g, dtype=F64) * 0.4
    old = torch.randn(4, 7, generator=g, dtype=F64) * 0.4
    adv = torch.randn(4, 7, generator=g, dtype=F64)
    m = torch.rand(4, 7, generator=g) < 0.7
    tokens, clipped = naive_ppo_tokens(lp, old, adv, m, 0.2, 0.3, dual)
    loss, met = ppo_policy_loss(lp, old, adv, m, clip_high=0.3, dual_clip=dual)
    assert loss.item() == pytest.approx(sum(tokens) / len(tokens))
    assert float(met["clip_frac"]) == pytest.approx(clipped / len(tokens))


def test_ppo_argument_errors():
    x, m = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="dual_clip=1.0 must be > 1"):
        ppo_policy_loss(x, x, x, m, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_low=1.0"):
        ppo_policy_loss(x, x, x, m, clip_low=1.0)
    with pytest.raises(ValueError, match="advantages has shape"):
        ppo_policy_loss(x, x, torch.zeros(3), m)
    with pytest.raises(ValueError, match="shape mismatch"):
        ppo_policy_loss(x, torch.zeros(1, 3), x, m)


def test_decoupled_equals_ppo_when_proximal_is_behavior():
    g = torch.Generator().manual_seed(1)
    lp = (torch.randn(4, 6, generator=g, dtype=F64) * 0.5).requires_grad_()
    prox = torch.randn(4, 6, generator=g, dtype=F64) * 0.5
    adv, m = torch.randn(4, generator=g, dtype=F64), torch.rand(4, 6, generator=g) < 0.8
    for agg in ("token-mean", "seq-mean-token-mean"):
        a, ma = decoupled_policy_loss(lp, prox, prox.clone(), adv, m, clip_high=0.28, agg=agg, dual_clip=3.0)
        (ga,) = torch.autograd.grad(a, lp)
        b, mb = ppo_policy_loss(lp, prox, adv, m, clip_high=0.28, agg=agg, dual_clip=3.0)
        (gb,) = torch.autograd.grad(b, lp)
        assert a.item() == b.item()
        torch.testing.assert_close(ga, gb, rtol=0, atol=0)
        for k in mb:
            assert float(ma[k]) == float(mb[k])
        assert float(ma["is_weight_mean"]) == 1.0 and float(ma["is_cap_frac"]) == 0.0


def test_decoupled_hand_values_with_truncation():
    # pi_prox/pi_behav = 2, 1, 4 -> capped at 2: weights 2, 1, 2.
    # PPO tokens vs proximal: r=1 (A=1) -> -1; r=1.5 (A=1) -> -1.2; r=.9 (A=-1) -> .9.
    lp = logs(1.0, 1.5, 0.9)
    prox = torch.zeros(1, 3, dtype=F64)
    behav = torch.log(torch.tensor([[0.5, 1.0, 0.25]], dtype=F64))
    adv, m = torch.tensor([[1.0, 1.0, -1.0]], dtype=F64), torch.ones(1, 3)
    loss, met = decoupled_policy_loss(lp, prox, behav, adv, m, is_cap=2.0)
    assert loss.item() == pytest.approx((-2.0 - 1.2 + 1.8) / 3)
    assert float(met["is_weight_mean"]) == pytest.approx(5 / 3)
    assert float(met["is_cap_frac"]) == pytest.approx(1 / 3)
    uncapped, _ = decoupled_policy_loss(lp, prox, behav, adv, m, is_cap=None)
    assert uncapped.item() == pytest.approx((-2.0 - 1.2 + 3.6) / 3)
    loss.backward()
    # The weight is a constant: token 1 grad = w * (-A r) / 3 = -2/3; token 2 clipped; token 3 = 2*.9/3.
    torch.testing.assert_close(lp.grad, torch.tensor([[-2 / 3, 0.0, 0.6]], dtype=F64))
    with pytest.raises(ValueError, match="is_cap=0"):
        decoupled_policy_loss(lp, prox, behav, adv, m, is_cap=0)


def test_value_loss_hand_values():
    v = torch.tensor([[1.0, 2.0, 0.5, 3.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[1.1, 1.5, 0.5, 2.0]], dtype=F64)
    ret = torch.tensor([[2.0, 1.0, 0.0, 3.0]], dtype=F64)
    # Per token 0.5*max: (1, 1)->.5; (1, .49)->.5; (.25, .25)->.125; (0, (2.2-3)^2=.64)->.32.
    loss, met = value_loss(v, old, ret, torch.ones(1, 4), clip=0.2)
    assert loss.item() == pytest.approx((0.5 + 0.5 + 0.125 + 0.32) / 4)
    assert float(met["vf_clip_frac"]) == pytest.approx(0.25)
    assert float(met["value_mean"]) == pytest.approx(6.5 / 4)
    loss.backward()
    # Token 4 uses the saturated clipped value: zero gradient. Others: (v - R) / 4.
    torch.testing.assert_close(v.grad, torch.tensor([[-0.25, 0.25, 0.125, 0.0]], dtype=F64))
    plain, _ = value_loss(v, old, ret, torch.ones(1, 4), clip=None)
    assert plain.item() == pytest.approx(0.5 * (1 + 1 + 0.25 + 0) / 4)


def test_value_loss_matches_naive_loop():
    g = torch.Generator().manual_seed(5)
    v, old, ret = (torch.randn(3, 6, generator=g, dtype=F64) for _ in range(3))
    m = torch.rand(3, 6, generator=g) < 0.7
    terms = []
    for i in range(3):
        for t in range(6):
            if m[i, t]:
                vc = float(old[i, t]) + min(max(float(v[i, t] - old[i, t]), -0.3), 0.3)
                terms.append(0.5 * max((float(v[i, t]) - float(ret[i, t])) ** 2, (vc - float(ret[i, t])) ** 2))
    loss, _ = value_loss(v, old, ret, m, clip=0.3)
    assert loss.item() == pytest.approx(sum(terms) / len(terms))


def test_explained_variance_hand_values():
    ret = torch.tensor([[1.0, 2.0, 3.0]])
    m = torch.ones(1, 3)
    assert float(value_loss(ret.clone(), ret, ret, m)[1]["explained_variance"]) == pytest.approx(1.0)
    const = torch.full((1, 3), 2.0)
    assert float(value_loss(const, const, ret, m)[1]["explained_variance"]) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="value clip=0"):
        value_loss(const, const, ret, m, clip=0.0)
