"""Exact-math tests for the advantage estimators against hand values and naive loops."""

from __future__ import annotations

import statistics

import pytest
import torch

from fuseflow.algorithms import dr_grpo, gae, grpo, reinforce_pp, reinforce_pp_baseline, remax, rloo

F64 = torch.float64


# ---------- naive references: compact each row to its masked-in tokens, then textbook loops ----------

def naive_gae(rewards, values, mask, gamma, lam):
    adv = torch.zeros_like(rewards, dtype=F64)
    for i in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[i, t]]
        nxt_v, nxt_a = 0.0, 0.0
        for t in reversed(idx):
            delta = float(rewards[i, t]) + gamma * nxt_v - float(values[i, t])
            nxt_a = delta + gamma * lam * nxt_a
            nxt_v = float(values[i, t])
            adv[i, t] = nxt_a
    ret = torch.where(mask.bool(), adv + values, 0.0)
    return adv, ret


def naive_return_to_go(rewards, mask, gamma):
    out = torch.zeros_like(rewards, dtype=F64)
    for i in range(rewards.shape[0]):
        g = 0.0
        for t in reversed([t for t in range(rewards.shape[1]) if mask[i, t]]):
            g = float(rewards[i, t]) + gamma * g
            out[i, t] = g
    return out


def naive_whiten(x, mask):
    vals = [float(x[i, t]) for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t]]
    mu, sd = statistics.mean(vals), statistics.stdev(vals)
    return torch.where(mask.bool(), (x - mu) / sd, 0.0)


def naive_groups(scores, gids):
    groups = {}
    for s, g in zip(scores.tolist(), gids.tolist(), strict=True):
        groups.setdefault(g, []).append(s)
    return groups


def naive_grpo(scores, gids, norm_by_std=True, eps=1e-6):
    groups = naive_groups(scores, gids)
    out = []
    for s, g in zip(scores.tolist(), gids.tolist(), strict=True):
        xs = groups[g]
        if len(xs) == 1:
            out.append(0.0)
            continue
        a = s - statistics.mean(xs)
        out.append(a / (statistics.stdev(xs) + eps) if norm_by_std else a)
    return torch.tensor(out, dtype=F64)


def naive_rloo(scores, gids):
    groups = naive_groups(scores, gids)
    out = []
    for s, g in zip(scores.tolist(), gids.tolist(), strict=True):
        xs = list(groups[g])
        xs.remove(s)
        out.append(s - sum(xs) / len(xs) if xs else 0.0)
    return torch.tensor(out, dtype=F64)


def random_case(seed, b=5, t=8):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, t, generator=g, dtype=F64)
    values = torch.randn(b, t, generator=g, dtype=F64)
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[0] = False  # an empty response
    return rewards, values, mask


# ---------- GAE ----------

def test_gae_hand_values_with_a_skipped_tool_token():
    # Position 1 is an observation token: its reward 9 and value 7 must be ignored.
    # Compact row: r=[0.1, 0, 1], V=[0.5, 0.2, 0.4], gamma=0.9, lam=0.8, gamma*lam=0.72:
    # A2 = 1 - 0.4 = 0.6; A1 = (0 + 0.9*0.4 - 0.2) + 0.72*0.6 = 0.592;
    # A0 = (0.1 + 0.9*0.2 - 0.5) + 0.72*0.592 = 0.20624.
    r = torch.tensor([[0.1, 9.0, 0.0, 1.0]], dtype=F64)
    v = torch.tensor([[0.5, 7.0, 0.2, 0.4]], dtype=F64)
    m = torch.tensor([[1, 0, 1, 1]])
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.20624, 0.0, 0.592, 0.6]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[0.70624, 0.0, 0.792, 1.0]], dtype=F64))


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    r = torch.tensor([[0.0, 0.0, 2.0, 0.0]], dtype=F64)
    v = torch.tensor([[0.3, 0.1, 0.7, 5.0]], dtype=F64)
    m = torch.tensor([[1, 1, 1, 0]])  # trailing padding
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[1.7, 1.9, 1.3, 0.0]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[2.0, 2.0, 2.0, 0.0]], dtype=F64))


@pytest.mark.parametrize("seed", range(4))
def test_gae_matches_naive_loop(seed):
    r, v, m = random_case(seed)
    adv, ret = gae(r, v, m, gamma=0.95, lam=0.9)
    ref_adv, ref_ret = naive_gae(r, v, m, 0.95, 0.9)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)


def test_gae_is_detached_and_upcasts_bf16():
    v = torch.randn(2, 3, requires_grad=True)
    adv, _ = gae(torch.ones(2, 3), v, torch.ones(2, 3), 1.0, 0.95)
    assert not adv.requires_grad
    adv16, _ = gae(torch.ones(2, 3, dtype=torch.bfloat16), torch.zeros(2, 3, dtype=torch.bfloat16), torch.ones(2, 3), 1.0, 1.0)
    assert adv16.dtype == torch.float32
    torch.testing.assert_close(adv16, torch.tensor([[3.0, 2.0, 1.0]] * 2))


def test_gae_shape_errors():
    with pytest.raises(ValueError, match="shape mismatch"):
        gae(torch.ones(2, 3), torch.ones(2, 4), torch.ones(2, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match="2-D"):
        gae(torch.ones(3), torch.ones(3), torch.ones(3), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"lam=1.5 must be in \[0, 1\]"):
        gae(torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3), 1.0, 1.5)
    with pytest.raises(ValueError, match=r"gamma=-0.1 must be in \[0, 1\]"):
        reinforce_pp(torch.ones(2, 3), torch.ones(2, 3), -0.1)


# ---------- group estimators ----------

# Three interleaved groups with non-contiguous ids: A=10 -> [1,0,0,1], B=-3 -> [2,4,9], C=0 -> [3].
SCORES = torch.tensor([1.0, 2.0, 0.0, 3.0, 4.0, 0.0, 1.0, 9.0], dtype=F64)
GIDS = torch.tensor([10, -3, 10, 0, -3, 10, 10, -3])


def test_grpo_hand_values():
    # A: mean .5, unbiased std sqrt(1/3); B: mean 5, std sqrt(13); C alone -> 0.
    a, b = 0.5 / (1 / 3) ** 0.5, 13**0.5
    expected = torch.tensor([a, -3 / b, -a, 0.0, -1 / b, -a, a, 4 / b], dtype=F64)
    torch.testing.assert_close(grpo(SCORES, GIDS, eps=0.0), expected)


def test_dr_grpo_hand_values():
    expected = torch.tensor([0.5, -3.0, -0.5, 0.0, -1.0, -0.5, 0.5, 4.0], dtype=F64)
    torch.testing.assert_close(dr_grpo(SCORES, GIDS), expected)
    torch.testing.assert_close(grpo(SCORES, GIDS, norm_by_std=False), expected)


def test_rloo_hand_values():
    expected = torch.tensor([2 / 3, -4.5, -2 / 3, 0.0, -1.5, -2 / 3, 2 / 3, 6.0], dtype=F64)
    torch.testing.assert_close(rloo(SCORES, GIDS), expected)


def test_grpo_all_equal_group_gives_zero():
    out = grpo(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 0, 1, 1]))
    torch.testing.assert_close(out[:3], torch.zeros(3))
    assert out[3] < 0 < out[4]


@pytest.mark.parametrize("seed", range(4))
def test_group_estimators_match_naive_loops(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(20, generator=g, dtype=F64)
    gids = torch.randint(-5, 6, (20,), generator=g) * 7
    torch.testing.assert_close(grpo(scores, gids), naive_grpo(scores, gids))
    torch.testing.assert_close(dr_grpo(scores, gids), naive_grpo(scores, gids, norm_by_std=False))
    torch.testing.assert_close(rloo(scores, gids), naive_rloo(scores, gids))


def test_group_inputs_are_validated():
    with pytest.raises(ValueError, match="group_ids has shape"):
        grpo(torch.ones(3), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="integers"):
        rloo(torch.ones(2), torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match="1-D"):
        grpo(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="map string uids to ints"):
        grpo(torch.ones(2), ["uid-a", "uid-b"])


def test_remax_hand_values_and_shape_check():
    torch.testing.assert_close(remax(torch.tensor([1.0, 0.5]), torch.tensor([0.25, 1.0])), torch.tensor([0.75, -0.5]))
    with pytest.raises(ValueError, match="shape mismatch"):
        remax(torch.ones(3), torch.ones(2))


# ---------- REINFORCE++ ----------

def test_reinforce_pp_hand_values():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 8.0]], dtype=F64)
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # gamma .5 -> returns-to-go [.25, .5, 1] and [1, 2]; mean .95; unbiased var 1.8/4 = .45.
    sd = 0.45**0.5
    expected = torch.tensor([[-0.7 / sd, -0.45 / sd, 0.05 / sd], [0.05 / sd, 1.05 / sd, 0.0]], dtype=F64)
    torch.testing.assert_close(reinforce_pp(r, m, gamma=0.5), expected)


@pytest.mark.parametrize("seed", range(3))
def test_reinforce_pp_matches_naive_loop(seed):
    r, _, m = random_case(seed)
    ref = naive_whiten(naive_return_to_go(r, m, 0.9), m)
    torch.testing.assert_close(reinforce_pp(r, m, 0.9), ref)


def test_reinforce_pp_baseline_hand_values():
    # Scores 1 and 3 share a group: centred -1 and +1, placed on each row's last
    # masked-in token (index 2 and index 1), on top of the per-token term -0.1.
    r = torch.tensor([[-0.1, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    got = reinforce_pp_baseline(r, m, 1.0, torch.tensor([1.0, 3.0]), torch.tensor([4, 4]))
    # Returns-to-go: [-1.1, -1, -1] and [1, 1]; mean -.22.
    vals = [-1.1, -1.0, -1.0, 1.0, 1.0]
    mu, sd = statistics.mean(vals), statistics.stdev(vals)
    expected = torch.tensor([[(-1.1 - mu) / sd, (-1 - mu) / sd, (-1 - mu) / sd], [(1 - mu) / sd, (1 - mu) / sd, 0]],
                            dtype=F64)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("seed", range(3))
def test_reinforce_pp_baseline_matches_naive_loop(seed):
    r, _, m = random_case(seed, b=6)
    g = torch.Generator().manual_seed(100 + seed)
    scores = torch.randn(6, generator=g, dtype=F64)
    gids = torch.tensor([1, 1, 2, 2, 2, 3])
    placed = r.clone()
    centred = naive_grpo(scores, gids, norm_by_std=False)
    for i in range(6):
        idx = [t for t in range(r.shape[1]) if m[i, t]]
        if idx:
            placed[i, idx[-1]] += centred[i]
    ref = naive_whiten(naive_return_to_go(placed, m, 0.97), m)
    torch.testing.assert_close(reinforce_pp_baseline(r, m, 0.97, scores, gids), ref)
