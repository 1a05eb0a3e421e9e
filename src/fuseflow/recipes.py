"""Per-algorithm recipes: which roles a run needs and how its advantages are formed.

An algorithm is a row of ``RECIPES`` (an estimator from the ``fuseflow.algorithms``
registry plus the roles it needs), never a copied trainer: ``RLTrainer.step`` reads the
recipe and stays the same program for all eight. The glue that is not a pure tensor
function of one estimator lives here too: token rewards with the KL penalty and the
run's KL controller, DAPO's overlong shaping and group filter, and Safe-RLHF's
Lagrange multiplier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fuseflow.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    call_with_inputs,
    get_advantage,
    kl_penalty,
    masked_mean,
    masked_whiten,
)
from fuseflow.data.batch import Batch


@dataclass(frozen=True)
class Recipe:
    """What one ``algorithm.name`` needs.

    advantage:        name in the advantage registry (``get_advantage``)
    critic:           a value model trained on the reward returns (GAE)
    cost_critic:      a second value model trained on the cost returns (safe_ppo)
    greedy_baseline:  one extra greedy rollout per prompt, scored as the baseline (remax)
    whiten:           whiten the token advantages over the batch (PPO's GAE is not whitened itself)
    score_in_tokens:  put the score on the last token of ``token_rewards``; False when the
                      estimator adds the (centred) score itself (reinforce_pp_baseline)
    """

    advantage: str
    critic: bool = False
    cost_critic: bool = False
    greedy_baseline: bool = False
    whiten: bool = False
    score_in_tokens: bool = True


RECIPES: dict[str, Recipe] = {
    "ppo": Recipe("gae", critic=True, whiten=True),
    "grpo": Recipe("grpo"),
    "dr_grpo": Recipe("dr_grpo"),
    "rloo": Recipe("rloo"),
    "remax": Recipe("remax", greedy_baseline=True),
    "reinforce_pp": Recipe("reinforce_pp"),
    "dapo": Recipe("grpo"),
    "safe_ppo": Recipe("gae", critic=True, cost_critic=True, whiten=True),
}


def recipe_for(algo) -> Recipe:
    """The recipe of an ``AlgorithmConfig`` (reinforce_pp picks its baseline variant by ``group_baseline``)."""
    if algo.name == "reinforce_pp" and algo.group_baseline:
        return Recipe("reinforce_pp_baseline", score_in_tokens=False)
    return RECIPES[algo.name]


def last_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) float, 1 on each response's last masked-in token (where a sequence reward lands)."""
    return ((mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask.bool()).float()


def estimate(recipe: Recipe, batch: Batch, scores: torch.Tensor, values: torch.Tensor | None,
             kl_term: torch.Tensor, algo) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages (B, T), returns (B, T) or None) from the recipe's registered estimator.

    ``scores`` (B,) is the sequence signal (reward or cost); ``kl_term`` (B, T) holds the
    per-token penalty already folded into rewards (zeros when KL is a loss term).
    Sequence-level advantages (B,) are broadcast over each response's tokens.
    """
    mask = batch["response_mask"]  # (B, T)
    token_rewards = kl_term + (scores.unsqueeze(-1) * last_token_mask(mask) if recipe.score_in_tokens else 0.0)
    inputs = {"token_rewards": token_rewards, "mask": mask, "gamma": algo.gamma, "lam": algo.lam,
              "scores": scores, "group_ids": torch.tensor(batch.meta["group_id"]), "norm_by_std": algo.norm_by_std}
    if values is not None:
        inputs["values"] = values
    if "baseline_scores" in batch:
        inputs["baseline_scores"] = batch["baseline_scores"]
    out = call_with_inputs(get_advantage(recipe.advantage), **inputs)
    adv, returns = out if isinstance(out, tuple) else (out, None)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    adv = adv * mask
    if recipe.whiten:
        adv = masked_whiten(adv, mask) * mask
    return adv, returns


def compute_advantages(batch: Batch, recipe: Recipe, algo, lagrange: float | None = None,
                       kl_coef: float | None = None) -> None:
    """Fill ``advantages`` (and ``returns``, ``cost_returns`` for critics) in ``batch``.

    ``kl_coef`` is this step's coefficient (``kl_controller(algo).value``; default
    ``algo.kl_coef``). safe_ppo combines the whitened reward and cost advantages as
    ``(A_r - lambda * A_c) / (1 + lambda)`` (Safe-RLHF), which keeps their scale as lambda grows.
    """
    mask = batch["response_mask"]
    kl_term = torch.zeros_like(mask)
    beta = algo.kl_coef if kl_coef is None else kl_coef
    if algo.kl_in_reward and beta > 0:
        kl_term = -beta * kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], "k1") * mask
    scores = torch.nan_to_num(batch["scores"], nan=0.0)
    adv, returns = estimate(recipe, batch, scores, batch["values"] if recipe.critic else None, kl_term, algo)
    if returns is not None:
        batch["returns"] = returns
    if recipe.cost_critic:
        costs = torch.nan_to_num(batch["costs"], nan=0.0)
        cost_adv, batch["cost_returns"] = estimate(recipe, batch, costs, batch["cost_values"],
                                                   torch.zeros_like(mask), algo)
        lam = float(lagrange or 0.0)
        adv = (adv - lam * cost_adv) / (1.0 + lam)
    batch["advantages"] = adv


# -------------------------------------------------------------------------------- KL
def kl_controller(algo) -> FixedKLController | AdaptiveKLController:
    """The KL coefficient of a run: fixed at ``kl_coef``, or adaptive toward ``kl_target`` when it is set."""
    if algo.kl_target is None:
        return FixedKLController(algo.kl_coef)
    return AdaptiveKLController(algo.kl_coef, algo.kl_target, algo.kl_horizon)


def observed_kl(batch: Batch, algo) -> float:
    """Per-token KL to the reference on this batch, by the estimator the coefficient multiplies.

    That is ``k1`` when the penalty is in the reward and ``algo.kl_kind`` when it is a loss
    term, averaged over every response token of the batch (before this step's update).
    """
    kind = "k1" if algo.kl_in_reward else algo.kl_kind
    mask = batch["response_mask"]
    return float(masked_mean(kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], kind), mask))


# ------------------------------------------------------------------------------ DAPO
def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (B,): 0 up to ``max_len - buffer`` tokens, then linear down to ``-factor``.

    ``R(|y|) = min(0, (max_len - buffer - |y|) / buffer) * factor`` for ``|y| <= max_len``;
    truncated responses have ``|y| = max_len`` and get ``-factor``. ``buffer=0`` disables it.

    >>> overlong_penalty(torch.tensor([10, 13, 16]), max_len=16, buffer=4)
    tensor([ 0.0000, -0.2500, -1.0000])
    """
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    if buffer >= max_len:
        raise ValueError(f"overlong buffer={buffer} must be smaller than max_len={max_len}")
    over = lengths.float() - (max_len - buffer)
    return -(over.clamp(min=0.0) / buffer).clamp(max=1.0) * factor


def informative_groups(scores: torch.Tensor, group_ids: list[int]) -> dict[int, bool]:
    """Per group id: True when its scores are not all equal (a group-relative advantage is then nonzero).

    A NaN score makes a group count as informative, so the NaN check downstream still sees it.

    >>> informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), [0, 0, 1, 1])
    {0: False, 1: True}
    """
    by_group: dict[int, list[float]] = {}
    for s, g in zip(scores.tolist(), group_ids, strict=True):
        by_group.setdefault(g, []).append(s)
    return {g: any(v != v for v in vals) or max(vals) > min(vals) for g, vals in by_group.items()}


# ------------------------------------------------------------------------- Safe-RLHF
class LagrangeMultiplier:
    """PPO-Lagrangian multiplier for a cost constraint ``E[cost] <= limit``.

    Projected gradient ascent on the dual: ``lambda <- max(0, lambda + lr * (mean_cost - limit))``.
    It grows while the policy breaks the limit and decays toward 0 once it is met, so
    the cost term weighs only as much as the constraint needs.

    >>> m = LagrangeMultiplier(init=1.0, lr=0.5, limit=0.1)
    >>> m.update(0.5), m.update(0.0)
    (1.2, 1.15)
    """

    def __init__(self, init: float, lr: float, limit: float):
        self.value, self.lr, self.limit = float(init), float(lr), float(limit)

    def update(self, mean_cost: float) -> float:
        """One dual ascent step on the step's mean cost: ``value += lr * (mean_cost - limit)``, kept at 0 or above.
        A NaN cost leaves it unchanged. Returns the new value."""
        if mean_cost == mean_cost:  # a NaN cost leaves the multiplier where it is
            self.value = max(0.0, self.value + self.lr * (mean_cost - self.limit))
        return self.value
