"""Critic role: a value model trained on GAE returns (PPO; safe_ppo has a second one for the cost)."""

from __future__ import annotations

import torch

from fuseflow.algorithms import value_loss
from fuseflow.controller.worker import register
from fuseflow.data.batch import Batch

from .actor import minibatches
from .common import (
    autocast,
    mean_metrics,
    prompt_cache,
    response_values,
    shares_prefix,
    sorted_inference,
    train_microbatches,
)
from .optim import adamw, clipped_step, set_lr
from .parallel import TrainableRole


class CriticWorker(TrainableRole):
    """Owns a ``ValueModel`` and its optimizer.

    ``prefix`` picks the batch fields it reads and trains on: ``""`` uses ``values``/``returns``
    (the reward critic); ``"cost_"`` uses ``cost_values``/``cost_returns`` (safe_ppo's cost critic).
    Its metrics are named after ``role`` (``critic/loss``, ``cost_critic/loss``).
    """

    token_budget = 4096  # padded tokens per forward (schedule.token_budget; the builder sets it)
    share_prefix = False  # one packed forward per micro-batch (schedule.shared_prefix; the builder sets it)

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, algo, trainer,
                 norm_len: int, prefix: str = "", role: str = "critic", plain: torch.nn.Module | None = None):
        self.model, self.device, self.dtype, self.algo, self.cfg = model, device, dtype, algo, trainer
        self.plain = model if plain is None else plain  # unsharded copy for checkpoints when model is sharded
        self.prefix, self.role = prefix, role
        self.norm_len = norm_len  # the configured max response length, for seq-mean-token-sum-norm
        self.optimizer = adamw(model.parameters(), trainer.critic_lr, trainer.weight_decay)

    def _values(self, mb: Batch) -> torch.Tensor:
        """(B, Tr) value of the state before each response token; shared prompts run once, responses
        unpadded (``response_values``) where that saves enough; without autograd, prompts already
        run under these weights come from the worker's ``PromptCache``."""
        with autocast(self.device, self.dtype):
            return response_values(self.model, mb, share_prefix=shares_prefix(self), prompt_cache=prompt_cache(self))

    @register("dp_split")
    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        """(B, Tr) value of the state before each response token (0 on padding)."""
        self.model.eval()
        return sorted_inference(batch, self.token_budget, lambda mb: self._values(mb.to(self.device)).cpu(),
                                worker=self)

    @register("dp_split", collect="rank_zero")
    def update(self, batch: Batch, lr: float, seed: int) -> dict[str, float]:
        """Epochs of mini-batch value-loss updates (data-parallel as ``ActorWorker.update``)."""
        self.model.train()
        set_lr(self.optimizer, lr)
        records = []
        for idx in minibatches(len(batch), self.cfg.mini_batch_size // self.world_size, self.cfg.epochs, seed):
            mini = batch.select(idx)
            n_tok, n_seq = self.global_counts(mini["response_mask"])
            role = self.role
            rec = {f"{role}/loss": 0.0, f"{role}/vf_clip_frac": 0.0}
            for mb in train_microbatches(self, mini, self.token_budget, self.cfg.micro_batch_size,
                                         by_prompt=shares_prefix(self)):
                mb = mb.to(self.device)
                loss, m = value_loss(self._values(mb), mb[self.prefix + "values"], mb[self.prefix + "returns"],
                                     mb["response_mask"], self.algo.value_clip, self.algo.loss_agg, n_tok, n_seq,
                                     self.norm_len)
                self.backward(loss)
                rec[f"{role}/loss"] += float(loss.detach())
                # Token-weighted over micro-batches (and ranks): the mini-batch's clip fraction.
                rec[f"{role}/vf_clip_frac"] += float(m["vf_clip_frac"]) * float(mb["response_mask"].sum() / n_tok)
            rec = self.all_reduce_sum(rec)
            rec[f"{role}/grad_norm"] = clipped_step(self.model, self.optimizer, self.cfg.grad_clip, role)
            records.append(rec)
        return mean_metrics(records)
