"""KL estimators against the reference policy, and KL coefficient controllers.

The estimators follow Schulman's "Approximating KL Divergence" note: with samples
from the current policy and ``d = logp - logp_ref``, each is an estimate of
KL(pi || pi_ref) per token.
"""

from __future__ import annotations

import torch

from fuseflow.algorithms.masked import check_same_shape

__all__ = ["KL_KINDS", "kl_penalty", "AdaptiveKLController", "FixedKLController"]

KL_KINDS = ("k1", "k2", "k3", "abs")

# Bound on k3: exp(ref - logp) explodes when the policy is far more confident than
# the reference; a clamp keeps one such token from dominating the loss.
K3_CLAMP = 10.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL estimate (same shape as the inputs, e.g. (B, T)).

    With ``d = logp - logp_ref``:

    - ``k1``: ``d`` (unbiased, high variance, can be negative);
    - ``k2``: ``0.5 * d^2`` (low variance, biased);
    - ``k3``: ``exp(-d) + d - 1`` clamped to [-10, 10] (unbiased, non-negative, low variance);
    - ``abs``: ``|d|``.

    As a reward penalty, call it on detached log-probs (``r_t -= beta * kl_t``); as a
    loss term, pass the live ``logprobs`` and it is differentiable (the k3 clamp stops
    the gradient on clamped tokens). Masking and reduction are the caller's job.

    >>> kl_penalty(torch.tensor([0.0]), torch.tensor([-1.0]), "k3")  # e^-1 + 1 - 1
    tensor([0.3679])
    """
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    if kind not in KL_KINDS:
        raise ValueError(f"kl kind {kind!r} is not known; choose one of {', '.join(KL_KINDS)}")
    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff * diff
    if kind == "abs":
        return diff.abs()
    log_ratio = -diff  # log(pi_ref / pi)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, min=-K3_CLAMP, max=K3_CLAMP)


class FixedKLController:
    """A KL coefficient that never changes; has the same interface as the adaptive one."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef={kl_coef} must be >= 0")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op, so the trainer can call ``update`` whichever controller it holds."""


class AdaptiveKLController:
    """Proportional controller that steers the observed KL toward ``target`` (Ziegler et al. 2019).

    After each step, ``e = clip(KL / target - 1, -0.2, 0.2)`` and
    ``beta <- beta * (1 + e * n_steps / horizon)``: the coefficient grows while the
    policy drifts too far from the reference and shrinks while it stays too close, by
    at most 20% per ``horizon`` samples.

    >>> c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    >>> c.update(current_kl=12.0, n_steps=256); round(c.value, 6)  # error clipped to +0.2
    0.100512
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef={init_kl_coef} must be >= 0")
        if not target > 0:
            raise ValueError(f"target={target} must be > 0 (the KL the controller steers toward)")
        if not horizon > 0:
            raise ValueError(f"horizon={horizon} must be > 0 (samples over which beta may change by 20%)")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient given the KL just observed over ``n_steps`` samples."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
