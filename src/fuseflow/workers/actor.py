"""Actor and reference roles: the policy being trained and its frozen anchor."""

from __future__ import annotations

import torch

from fuseflow.algorithms import (
    aggregate,
    aggregation_counts,
    call_with_inputs,
    get_policy_loss,
    kl_penalty,
    masked_mean,
)
from fuseflow.data.batch import Batch
from fuseflow.rollout.base import RolloutBackend, RolloutRequest, Sample

from .common import autocast, clipped_step, mean_metrics, response_logprobs, set_lr


def minibatches(n: int, size: int, epochs: int, seed: int) -> list[torch.Tensor]:
    """Index sets of each optimizer step: a fresh shuffle per epoch from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        out.extend(perm[i : i + size] for i in range(0, n, size))
    return out


class ReferenceWorker:
    """Holds the frozen reference policy and scores log-probs under it."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, temperature: float,
                 micro_batch_size: int):
        self.model = model.eval().requires_grad_(False)
        self.device, self.dtype, self.temperature, self.mbs = device, dtype, temperature, micro_batch_size

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """(B, Tr) log-probs of each response token under this worker's model."""
        outs = []
        for mb in batch.split(self.mbs):
            with autocast(self.device, self.dtype):
                outs.append(response_logprobs(self.model, mb.to(self.device), self.temperature).cpu())
        return torch.cat(outs)


class ActorWorker(ReferenceWorker):
    """The policy: generates through its rollout backend and trains with the configured policy loss.

    ``algorithm.policy_loss`` names a registered loss (``get_policy_loss``): ``ppo`` clips
    against ``old_logprobs``; ``decoupled`` clips against them as the proximal policy and
    weights each token by the truncated ratio to the rollout's ``behavior_logprobs``.
    """

    role = "actor"  # names its checkpoint files (optim_actor)

    def __init__(self, model: torch.nn.Module, rollout: RolloutBackend, device: torch.device, dtype: torch.dtype,
                 algo, trainer, temperature: float, norm_len: int):
        self.model, self.rollout, self.norm_len = model, rollout, norm_len
        self.device, self.dtype, self.temperature = device, dtype, temperature
        self.algo, self.cfg, self.mbs = algo, trainer, trainer.micro_batch_size
        self.policy_loss = get_policy_loss(algo.policy_loss)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=trainer.lr, weight_decay=trainer.weight_decay,
                                           betas=(0.9, 0.95))

    def generate(self, requests: list[RolloutRequest]) -> list[Sample]:
        samples = list(self.rollout.generate(requests))
        order = {r.uid: i for i, r in enumerate(requests)}
        return sorted(samples, key=lambda s: order[s.uid])

    def update(self, batch: Batch, lr: float, kl_coef: float, seed: int) -> dict[str, float]:
        """Epochs of mini-batch policy-loss updates; gradients accumulate over micro-batches exactly.

        The loss of each micro-batch is normalised by its mini-batch's global token and
        sequence counts, so the accumulated gradient equals the whole mini-batch's.
        """
        self.model.train()
        set_lr(self.optimizer, lr)
        algo, records = self.algo, []
        for idx in minibatches(len(batch), self.cfg.mini_batch_size, self.cfg.epochs, seed):
            mini = batch.select(idx)
            n_tok, n_seq = aggregation_counts(mini["response_mask"])
            rec: dict[str, float] = {}
            for mb in mini.split(self.mbs):
                mb = mb.to(self.device)
                mask = mb["response_mask"]
                with autocast(self.device, self.dtype):
                    logp, entropy = response_logprobs(self.model, mb, self.temperature, with_entropy=True)
                # old_logprobs (before this update) is PPO's anchor and the decoupled loss's proximal policy.
                pg_loss, m = call_with_inputs(
                    self.policy_loss, logprobs=logp, old_logprobs=mb["old_logprobs"],
                    proximal_logprobs=mb["old_logprobs"], behavior_logprobs=mb["behavior_logprobs"],
                    advantages=mb["advantages"], mask=mask, clip_low=algo.clip_low, clip_high=algo.clip_high,
                    is_cap=algo.is_cap, agg=algo.loss_agg, num_global_tokens=n_tok, num_global_seqs=n_seq,
                    norm_len=self.norm_len)
                loss = pg_loss
                if not algo.kl_in_reward and kl_coef > 0:
                    kl = aggregate(kl_penalty(logp, mb["ref_logprobs"], algo.kl_kind), mask, algo.loss_agg,
                                   n_tok, n_seq, self.norm_len)
                    loss = loss + kl_coef * kl
                loss.backward()
                share = float(mask.sum() / n_tok)  # this micro-batch's share of the mini-batch metrics
                for k, v in {"actor/pg_loss": pg_loss, "actor/loss": loss, "actor/clip_frac": m["clip_frac"],
                             "actor/approx_kl": m["approx_kl"],
                             "actor/entropy": masked_mean(entropy.detach(), mask),
                             **{f"actor/{k}": m[k] for k in ("is_weight_mean", "is_cap_frac") if k in m}}.items():
                    rec[k] = rec.get(k, 0.0) + float(v.detach()) * (1.0 if k.endswith("loss") else share)
            rec["actor/grad_norm"] = clipped_step(self.model, self.optimizer, self.cfg.grad_clip, "actor")
            records.append(rec)
        return mean_metrics(records)
