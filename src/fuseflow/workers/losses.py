"""The actor's per-micro-batch loss and the mini-batch order: shared by ``ActorWorker.update`` and the
pipeline stages (``schedule/pipeline/losses.py``). Kept light (no tokenizer or rollout imports), so a
stage process loads it in a moment."""

from __future__ import annotations

import torch

from fuseflow.algorithms import aggregate, call_with_inputs, kl_penalty, masked_mean


def minibatches(n: int, size: int, epochs: int, seed: int) -> list[torch.Tensor]:
    """Index sets of each optimizer step: a fresh shuffle per epoch from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        out.extend(perm[i : i + size] for i in range(0, n, size))
    return out


def actor_loss(policy_loss, algo, logp: torch.Tensor, entropy: torch.Tensor, mb, kl_coef: float,
               n_tok: torch.Tensor, n_seq: torch.Tensor, norm_len: int) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's share of the actor's loss, and its share of the mini-batch metrics.

    ``logp``/``entropy`` (B, Tr) come from the policy's logits (``response_logprobs``); ``mb`` holds
    the batch fields (``old_logprobs``, ``behavior_logprobs``, ``advantages``, ``ref_logprobs``,
    ``response_mask``); ``n_tok``/``n_seq`` are the whole mini-batch's counts, so the losses of its
    micro-batches sum to the mini-batch's. Shared by ``ActorWorker.update`` and the pipeline stages.
    """
    mask = mb["response_mask"]
    # old_logprobs (before this update) is PPO's anchor and the decoupled loss's proximal policy.
    pg_loss, m = call_with_inputs(
        policy_loss, logprobs=logp, old_logprobs=mb["old_logprobs"],
        proximal_logprobs=mb["old_logprobs"], behavior_logprobs=mb["behavior_logprobs"],
        advantages=mb["advantages"], mask=mask, clip_low=algo.clip_low, clip_high=algo.clip_high,
        is_cap=algo.is_cap, tis_cap=algo.rollout_is_cap if algo.rollout_is == "tis" else None,
        agg=algo.loss_agg, num_global_tokens=n_tok, num_global_seqs=n_seq, norm_len=norm_len)
    loss = pg_loss
    if not algo.kl_in_reward and kl_coef > 0:
        kl = aggregate(kl_penalty(logp, mb["ref_logprobs"], algo.kl_kind), mask, algo.loss_agg, n_tok, n_seq,
                       norm_len)
        loss = loss + kl_coef * kl
    share = float(mask.sum() / n_tok)  # this micro-batch's share of the mini-batch metrics
    metrics = {"actor/pg_loss": pg_loss, "actor/loss": loss, "actor/clip_frac": m["clip_frac"],
               "actor/approx_kl": m["approx_kl"], "actor/entropy": masked_mean(entropy.detach(), mask),
               **{f"actor/{k}": m[k] for k in ("is_weight_mean", "is_cap_frac") if k in m}}
    return loss, {k: float(v.detach()) * (1.0 if k.endswith("loss") else share) for k, v in metrics.items()}
