"""Advantage estimators: turn rewards (and maybe values) into per-sample credit.

Token-level estimators (``gae``, ``reinforce_pp*``) work on ``(B, T)`` tensors over
response tokens. A position whose mask is 0 (padding, or a tool/observation token
inside a multi-turn response) is *skipped*: it gets advantage 0 and the backward
recursion carries the next value and next advantage straight over it, as if the
token were not there. Rewards and values at such positions are ignored, so place
rewards on masked-in tokens.

Sequence-level estimators (``grpo``, ``dr_grpo``, ``rloo``, ``remax``) return ``(B,)``;
the loss broadcasts them over each response's tokens. ``group_ids`` are arbitrary
integers (any order, not contiguous) marking samples of the same prompt.

All estimators run under ``torch.no_grad``: advantages are targets, never a path
for gradients.
"""

from __future__ import annotations

import torch

from fuseflow.algorithms.masked import as_bool_mask, check_same_shape, masked_whiten
from fuseflow.algorithms.registry import register_advantage

__all__ = ["gae", "grpo", "dr_grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline"]


def _float(x: torch.Tensor) -> torch.Tensor:
    # Accumulate in at least fp32: bf16 recursions over thousands of tokens drift.
    x = torch.as_tensor(x)
    return x.to(torch.promote_types(x.dtype, torch.float32)) if x.is_floating_point() else x.float()


def _check_2d(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (B, T) over response tokens, got shape {tuple(x.shape)}")


def _check_discount(**factors: float) -> None:
    for name, value in factors.items():
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}={value} must be in [0, 1]")


def _groups(scores: torch.Tensor, group_ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (scores as float (B,), inverse index (B,), group size per sample (B,))."""
    scores = _float(scores)
    try:
        gids = torch.as_tensor(group_ids, device=scores.device)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError("group_ids must be integers, one per sample (map string uids to ints first, "
                         f"e.g. with a dict); got {type(group_ids).__name__}") from None
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D (B,), got shape {tuple(scores.shape)}")
    if gids.shape != scores.shape:
        raise ValueError(f"group_ids has shape {tuple(gids.shape)} but scores has {tuple(scores.shape)}; "
                         "give one group id per sample")
    if gids.is_floating_point():
        raise ValueError("group_ids must be integers (one id per prompt), got a floating-point tensor")
    _, inverse, counts = torch.unique(gids, return_inverse=True, return_counts=True)
    return scores, inverse, counts[inverse]


def _group_sum(values: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Per-sample sum of ``values`` over the sample's group (B,)."""
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    sums = torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)
    return sums[inverse]


@register_advantage("gae")
@torch.no_grad()
def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016), not whitened.

    Over masked-in tokens t, with t' the next masked-in token (V=0, A=0 past the last):
    ``delta_t = r_t + gamma * V_t' - V_t`` and ``A_t = delta_t + gamma * lam * A_t'``;
    ``returns_t = A_t + V_t``. Masked-out positions get 0 in both outputs.

    >>> gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.5]]), torch.ones(1, 2), 1.0, 1.0)[0]
    tensor([[0.5000, 0.5000]])
    """
    check_same_shape(token_rewards=token_rewards, values=values, mask=mask)
    _check_2d("token_rewards", token_rewards)
    _check_discount(gamma=gamma, lam=lam)
    m = as_bool_mask(mask, token_rewards)  # (B, T)
    r, v = _float(token_rewards), _float(values)  # (B, T)
    batch, length = r.shape
    adv = torch.zeros_like(r)
    next_value = torch.zeros(batch, dtype=r.dtype, device=r.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(length)):
        keep = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        # Skipped tokens carry (next_value, next_adv) over themselves unchanged.
        next_value = torch.where(keep, v[:, t], next_value)
        next_adv = torch.where(keep, a_t, next_adv)
        adv[:, t] = torch.where(keep, a_t, 0.0)
    returns = torch.where(m, adv + v, 0.0)
    return adv, returns


@register_advantage("grpo")
@torch.no_grad()
def grpo(scores: torch.Tensor, group_ids, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantage (GRPO, Shao et al. 2024): ``(s_i - mean_g) / (std_g + eps)``.

    ``std_g`` is the unbiased (n-1) standard deviation of the group; a group of one
    sample has no baseline and gets 0. ``norm_by_std=False`` gives ``s_i - mean_g``
    (Dr. GRPO, Liu et al. 2025), which does not up-weight nearly-solved prompts.

    >>> grpo(torch.tensor([1.0, 0.0, 5.0]), torch.tensor([7, 7, 3]), eps=0.0)
    tensor([ 0.7071, -0.7071,  0.0000])
    """
    s, inverse, n = _groups(scores, group_ids)  # (B,) each
    mean = _group_sum(s, inverse) / n
    dev = s - mean
    adv = dev
    if norm_by_std:
        var = _group_sum(dev * dev, inverse) / (n - 1).clamp(min=1)
        adv = dev / (var.sqrt() + eps)
    return torch.where(n > 1, adv, torch.zeros_like(adv))


@register_advantage("dr_grpo")
@torch.no_grad()
def dr_grpo(scores: torch.Tensor, group_ids) -> torch.Tensor:
    """Dr. GRPO advantage ``s_i - mean_g`` (GRPO without the std division)."""
    return grpo(scores, group_ids, norm_by_std=False)


@register_advantage("rloo")
@torch.no_grad()
def rloo(scores: torch.Tensor, group_ids) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): ``s_i - mean_{j != i in g} s_j``.

    Equals ``n/(n-1) * (s_i - mean_g)``; a group of one gets 0.

    >>> rloo(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0, 0, 0]))
    tensor([ 0.0000, -1.5000,  1.5000])
    """
    s, inverse, n = _groups(scores, group_ids)
    others_mean = (_group_sum(s, inverse) - s) / (n - 1).clamp(min=1)
    return torch.where(n > 1, s - others_mean, torch.zeros_like(s))


@register_advantage("remax")
@torch.no_grad()
def remax(scores: torch.Tensor, baseline_scores: torch.Tensor) -> torch.Tensor:
    """ReMax (Li et al. 2023): ``s_i - b_i``, ``b_i`` the score of the greedy response to the same prompt."""
    s, b = _float(scores), _float(baseline_scores)
    check_same_shape(scores=s, baseline_scores=b)
    if s.dim() != 1:
        raise ValueError(f"scores must be 1-D (B,), got shape {tuple(s.shape)}")
    return s - b


def _return_to_go(r: torch.Tensor, m: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_t'`` over masked-in tokens (t' the next one), 0 elsewhere."""
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in reversed(range(r.shape[1])):
        keep = m[:, t]
        g = r[:, t] + gamma * running
        running = torch.where(keep, g, running)
        out[:, t] = torch.where(keep, g, 0.0)
    return out


@register_advantage("reinforce_pp")
@torch.no_grad()
def reinforce_pp(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): discounted return-to-go, whitened over the batch's masked-in tokens.

    ``A_t = whiten(G_t)`` with ``G_t = r_t + gamma * G_t'`` (t' the next masked-in token);
    whitening uses one mean and unbiased std over every masked-in token of the batch
    (:func:`masked_whiten`). ``token_rewards`` holds the score on the last response
    token plus any per-token terms such as a KL penalty.
    """
    check_same_shape(token_rewards=token_rewards, mask=mask)
    _check_2d("token_rewards", token_rewards)
    _check_discount(gamma=gamma)
    m = as_bool_mask(mask, token_rewards)
    return masked_whiten(_return_to_go(_float(token_rewards), m, gamma), m)


@register_advantage("reinforce_pp_baseline")
@torch.no_grad()
def reinforce_pp_baseline(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float, scores: torch.Tensor, group_ids
) -> torch.Tensor:
    """REINFORCE++ with a group-mean baseline on the sequence score.

    Variant (as in OpenRLHF's ``reinforce_baseline``): the score is centred by its
    group mean, ``s_i - mean_g`` (no std division; groups of one give 0), added to
    ``token_rewards`` at the last masked-in token of each response, and the result
    goes through :func:`reinforce_pp`. So ``token_rewards`` must NOT already contain the
    score: pass only per-token terms (e.g. ``-beta * kl``) or zeros.
    """
    check_same_shape(token_rewards=token_rewards, mask=mask)
    _check_2d("token_rewards", token_rewards)
    m = as_bool_mask(mask, token_rewards)
    r = _float(token_rewards)
    if torch.as_tensor(scores).shape != (r.shape[0],):
        raise ValueError(f"scores must have shape ({r.shape[0]},) (one per response), "
                         f"got {tuple(torch.as_tensor(scores).shape)}")
    centred = grpo(scores, group_ids, norm_by_std=False).to(device=r.device, dtype=r.dtype)  # (B,)
    length = r.shape[1]
    # Index of the last masked-in token: first hit when scanning the flipped mask.
    last = (length - 1) - m.flip(-1).to(torch.int8).argmax(dim=-1)  # (B,)
    onehot = torch.zeros_like(r).scatter_(1, last.unsqueeze(1), 1.0)
    onehot = onehot * m.any(dim=-1, keepdim=True)  # empty responses receive nothing
    return reinforce_pp(r + onehot * centred.unsqueeze(1), m, gamma)
