"""Policy and value losses, each returning ``(scalar loss, metrics)``.

Losses are built per token and reduced with :func:`aggregate`, so every loss takes
the same ``agg`` / ``num_global_tokens`` / ``num_global_seqs`` / ``norm_len``
arguments and accumulates over micro-batches without changing the result.

Masked-out positions are replaced by neutral values *before* any arithmetic, so a
NaN or inf there can reach neither the loss nor the gradient. Metrics are detached
0-dim tensors (call ``float()`` when logging; no device sync happens here) and are
local masked means over this micro-batch's tokens.
"""

from __future__ import annotations

import torch

from fuseflow.algorithms.aggregation import Count, aggregate
from fuseflow.algorithms.masked import as_bool_mask, check_same_shape, masked_mean
from fuseflow.algorithms.registry import register_policy_loss

__all__ = ["ppo_policy_loss", "decoupled_policy_loss", "rollout_mismatch", "truncated_is_weight", "value_loss"]


def _check_clip(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low={clip_low} must be in [0, 1): the ratio is clipped below at 1 - clip_low")
    if clip_high < 0.0:
        raise ValueError(f"clip_high={clip_high} must be >= 0: the ratio is clipped above at 1 + clip_high")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1 (the cap on -A*ratio for negative A), or None")


def _broadcast_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-sequence (B,) advantages become (B, T); (B, T) ones pass through."""
    if advantages.shape == like.shape:
        return advantages
    if advantages.dim() == 1 and like.dim() == 2 and advantages.shape[0] == like.shape[0]:
        return advantages.unsqueeze(1).expand_as(like)
    raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected (B,) = ({like.shape[0]},) "
                     f"or (B, T) = {tuple(like.shape)}")


def _clipped_surrogate(
    logprobs: torch.Tensor,
    anchor_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    m: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped PPO loss against ``anchor_logprobs`` (B, T) and its metrics."""
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = torch.where(m, _broadcast_advantages(advantages, logprobs).detach().to(logprobs.dtype), zero)
    log_ratio = torch.where(m, logprobs - anchor_logprobs.detach(), zero)  # (B, T)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(m)
    if dual_clip is not None:
        # For A < 0 a huge ratio would give an unbounded loss; cap it at -dual_clip * A.
        cap = -adv * dual_clip
        dual_active = (adv < 0) & (loss > cap)
        loss = torch.where(dual_active, cap, loss)
    with torch.no_grad():
        lr = log_ratio.detach()
        metrics = {
            "clip_frac": masked_mean((clipped > unclipped).to(lr.dtype), m),
            # k3 estimate of KL(anchor || current) from anchor samples: (r - 1) - log r.
            "approx_kl": masked_mean(torch.expm1(lr) - lr, m),
            "ratio_mean": masked_mean(ratio.detach(), m),
            "dual_clip_frac": masked_mean(dual_active.to(lr.dtype), m),
        }
    return loss, metrics


@register_policy_loss("ppo")
def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    num_global_tokens: Count | None = None,
    num_global_seqs: Count | None = None,
    norm_len: int | None = None,
    behavior_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clipping (DAPO's clip-higher) and dual clip.

    Per token, ``r = exp(logp - logp_old)``:
    ``l = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))``, and with dual clip
    ``c > 1``, for ``A < 0``: ``l = min(l, -c * A)`` (Ye et al. 2020). Reduced by
    :func:`aggregate` with ``agg``. ``advantages`` is (B,) (one per sequence) or (B, T).

    With ``tis_cap`` (``algorithm.rollout_is=tis``), each token is weighted by the truncated
    importance ratio between the trainer's old log-probs and the rollout's behaviour log-probs,
    ``w = min(exp(logp_old - logp_behav), tis_cap)`` (detached; see :func:`truncated_is_weight`):
    the rollout engine (vLLM in bf16, say) samples from a slightly different distribution than
    the trainer computes, and TIS (Yao et al. 2025; verl, TRL) corrects for it.

    Metrics: ``clip_frac`` (tokens where the clipped branch is taken), ``approx_kl``
    (mean k3 estimate ``(r - 1) - log r`` of KL(old || new)), ``ratio_mean``,
    ``dual_clip_frac`` (tokens capped by the dual clip); with TIS also ``is_weight_mean``
    and ``is_cap_frac``.
    """
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, mask=mask)
    _check_clip(clip_low, clip_high, dual_clip)
    m = as_bool_mask(mask, logprobs)
    loss_mat, metrics = _clipped_surrogate(logprobs, old_logprobs, advantages, m, clip_low, clip_high, dual_clip)
    if tis_cap is not None:
        if behavior_logprobs is None:
            raise ValueError("tis_cap is set but behavior_logprobs is None: TIS weighs by pi_old / pi_behaviour")
        check_same_shape(logprobs=logprobs, behavior_logprobs=behavior_logprobs)
        weight, is_metrics = truncated_is_weight(old_logprobs, behavior_logprobs, m, tis_cap, "tis_cap")
        loss_mat = loss_mat * weight.to(loss_mat.dtype)
        metrics |= is_metrics
    loss = aggregate(loss_mat, m, agg, num_global_tokens, num_global_seqs, norm_len)
    return loss, metrics


def rollout_mismatch(behavior_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                     threshold: float = 0.1) -> dict[str, float]:
    """How far the rollout's behaviour log-probs are from the trainer's, over masked-in tokens (B, T).

    Returns ``logprob_diff_max`` and ``logprob_diff_mean`` (of ``|behaviour - old|``) and
    ``logprob_diff_frac`` (share of tokens whose difference exceeds ``threshold``). Zero for an
    engine that shares the trainer's weights and arithmetic; vLLM, or a bf16 rollout against an
    fp32 trainer, shows here what ``algorithm.rollout_is=tis`` corrects.
    """
    check_same_shape(behavior_logprobs=behavior_logprobs, old_logprobs=old_logprobs, mask=mask)
    m = as_bool_mask(mask, old_logprobs)
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    diff = torch.where(m, (behavior_logprobs.to(old_logprobs.dtype) - old_logprobs).abs(), zero)
    n = int(m.sum())
    if n == 0:
        return {"logprob_diff_max": 0.0, "logprob_diff_mean": 0.0, "logprob_diff_frac": 0.0}
    return {"logprob_diff_max": float(diff.max()), "logprob_diff_mean": float(diff.sum()) / n,
            "logprob_diff_frac": float((diff > threshold).sum()) / n}


def truncated_is_weight(num_logprobs: torch.Tensor, den_logprobs: torch.Tensor, m: torch.Tensor,
                        cap: float | None, name: str = "is_cap") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token ``min(exp(num - den), cap)`` (B, T), detached, 0 where ``m`` is False.

    Metrics: ``is_weight_mean`` (after truncation) and ``is_cap_frac`` (tokens truncated), masked
    means. ``cap=None`` leaves the ratio untruncated. ``name`` is the setting an error names.
    """
    if cap is not None and not cap > 0:
        raise ValueError(f"{name}={cap} must be > 0 (the truncation of the importance ratio), or None")
    with torch.no_grad():
        zero = torch.zeros((), dtype=num_logprobs.dtype, device=num_logprobs.device)
        weight = torch.exp(torch.where(m, num_logprobs - den_logprobs, zero))
        capped = torch.zeros_like(m) if cap is None else m & (weight > cap)
        if cap is not None:
            weight = torch.clamp(weight, max=cap)
        weight = torch.where(m, weight, zero)
        metrics = {"is_weight_mean": masked_mean(weight, m), "is_cap_frac": masked_mean(capped.to(weight.dtype), m)}
    return weight, metrics


@register_policy_loss("decoupled")
def decoupled_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_cap: float | None = 2.0,
    agg: str = "token-mean",
    num_global_tokens: Count | None = None,
    num_global_seqs: Count | None = None,
    norm_len: int | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO for samples drawn by an older (behaviour) policy (AReaL, Fu et al. 2025).

    The trust region is centred on the proximal policy (the policy at the start of this
    update), while the behaviour policy that actually sampled the tokens is corrected
    for by importance weighting, truncated as in TIS:
    ``w = min(exp(logp_prox - logp_behav), is_cap)`` (detached) and, with
    ``r = exp(logp - logp_prox)``,
    ``l = w * max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))``.
    ``is_cap=None`` disables truncation. With proximal == behaviour, ``w = 1`` and this
    is exactly :func:`ppo_policy_loss`.

    Metrics: those of :func:`ppo_policy_loss` (against the proximal policy) plus
    ``is_weight_mean`` (after truncation) and ``is_cap_frac`` (tokens truncated).
    """
    check_same_shape(logprobs=logprobs, proximal_logprobs=proximal_logprobs,
                     behavior_logprobs=behavior_logprobs, mask=mask)
    _check_clip(clip_low, clip_high, dual_clip)
    m = as_bool_mask(mask, logprobs)
    weight, is_metrics = truncated_is_weight(proximal_logprobs.to(logprobs.dtype), behavior_logprobs.to(logprobs.dtype),
                                             m, is_cap)
    loss_mat, metrics = _clipped_surrogate(logprobs, proximal_logprobs, advantages, m, clip_low, clip_high,
                                           dual_clip)
    loss = aggregate(loss_mat * weight, m, agg, num_global_tokens, num_global_seqs, norm_len)
    metrics |= is_metrics
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    num_global_tokens: Count | None = None,
    num_global_seqs: Count | None = None,
    norm_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: ``0.5 * max((v - R)^2, (v_clip - R)^2)``.

    ``v_clip = v_old + clip(v - v_old, -clip, clip)`` keeps the critic from moving far
    from the values the advantages were computed with. ``clip=None`` gives the plain
    ``0.5 * (v - R)^2``. Metrics: ``vf_clip_frac`` (tokens where the clipped term is the
    larger), ``explained_variance`` (``1 - Var(R - v) / Var(R)`` over masked-in tokens;
    1 is a perfect critic, 0 no better than a constant), ``value_mean``.
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    if clip is not None and not clip > 0:
        raise ValueError(f"value clip={clip} must be > 0, or None to disable clipping")
    m = as_bool_mask(mask, values)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(m, values, zero)  # (B, T)
    ret = torch.where(m, returns.detach().to(values.dtype), zero)
    err = (v - ret) ** 2
    if clip is None:
        loss_mat = 0.5 * err
        clipped_more = torch.zeros_like(m)
    else:
        v_old = torch.where(m, old_values.detach().to(values.dtype), zero)
        v_clip = v_old + torch.clamp(v - v_old, -clip, clip)
        err_clip = (v_clip - ret) ** 2
        loss_mat = 0.5 * torch.maximum(err, err_clip)
        clipped_more = err_clip > err
    loss = aggregate(loss_mat, m, agg, num_global_tokens, num_global_seqs, norm_len)
    with torch.no_grad():
        vd, rd = v.detach(), ret.detach()
        resid = rd - vd
        var_r = masked_mean((rd - masked_mean(rd, m)) ** 2, m)
        var_res = masked_mean((resid - masked_mean(resid, m)) ** 2, m)
        ev = torch.where(var_r > 0, 1.0 - var_res / var_r.clamp(min=1e-12), torch.zeros_like(var_r))
        metrics = {
            "vf_clip_frac": masked_mean(clipped_more.to(vd.dtype), m),
            "explained_variance": ev,
            "value_mean": masked_mean(vd, m),
        }
    return loss, metrics
