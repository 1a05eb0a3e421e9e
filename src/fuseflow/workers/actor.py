"""Actor and reference roles: the policy being trained and its frozen anchor."""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path

import torch

from fuseflow.algorithms import (
    get_policy_loss,
)
from fuseflow.controller.worker import Worker, register
from fuseflow.data.batch import Batch
from fuseflow.rollout.base import RolloutBackend, RolloutRequest, Sample

from .common import (
    autocast,
    mean_metrics,
    prompt_cache,
    response_logprobs,
    shares_prefix,
    sorted_inference,
    train_microbatches,
)
from .evaluation import HeldOut
from .losses import actor_loss, minibatches
from .optim import adamw, clipped_step, set_lr
from .parallel import TrainableRole


class ReferenceWorker(Worker):
    """Holds the frozen reference policy and scores log-probs under it."""

    role = "reference"
    heldout: HeldOut | None = None  # set by the builder: held-out prompts for evaluate / sample_heldout

    token_budget = 4096  # padded tokens per inference forward (schedule.token_budget; the builder sets it)
    share_prefix = False  # run each distinct prompt once (schedule.shared_prefix; the builder sets it)

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, temperature: float):
        self.model = self.plain = model.eval().requires_grad_(False)
        self.device, self.dtype, self.temperature = device, dtype, temperature

    @register("dp_split")
    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """(B, Tr) log-probs of each response token under this worker's model (0 on padding)."""
        self.model.eval()  # no dropout (LoRA's) in scoring; update() switches back to train()

        def run(mb: Batch) -> torch.Tensor:
            with autocast(self.device, self.dtype):
                return response_logprobs(self.model, mb.to(self.device), self.temperature,
                                         share_prefix=shares_prefix(self), prompt_cache=prompt_cache(self)).cpu()

        return sorted_inference(batch, self.token_budget, run, worker=self)

    @register("rank_zero")
    def evaluate(self) -> dict[str, float]:
        """Greedy held-out accuracy (and cost rate) of this worker's whole model."""
        return self.heldout.greedy(self.plain)

    @register("rank_zero")
    def sample_heldout(self) -> list[str]:
        """Seeded sampled responses to the held-out prompts (paired with another model's by seed)."""
        return self.heldout.sampled(self.plain)

    @register("rank_zero")
    def rollout_model(self, copy: bool = False) -> torch.nn.Module:
        """The unsharded model a rollout in this process decodes with: this worker's own (weights shared,
        so an update reaches it in place) or, with ``copy``, a frozen copy of it that ``rollout_weights``
        refreshes (async generation decodes while the actor trains)."""
        return deepcopy(self.plain).eval().requires_grad_(False) if copy else self.plain

    @register("rank_zero")
    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """The current weights for a rollout copy (in-process: the live tensors, not a copy)."""
        return self.plain.state_dict()

    @register("rank_zero")
    def weight_signature(self) -> list:
        """(name, shape, dtype) per parameter in broadcast order (rollout replicas must match it)."""
        from fuseflow.controller.weight_sync import signature

        return signature(self.plain)

    @register("rank_zero")
    def join_weight_group(self, addr: str, port: int, world_size: int, timeout_s: float) -> None:
        """Become rank 0 (the source) of the weight group with the rollout replicas (backend=ray)."""
        from fuseflow.controller.weight_sync import WeightGroup

        self.weight_group = WeightGroup(addr, port, 0, world_size, timeout_s, self.device.type)

    @register("rank_zero")
    def broadcast_weights(self) -> int:
        """Send the current (gathered) weights to the rollout replicas: flat buckets, one broadcast each;
        returns the bytes each replica received."""
        return self.weight_group.broadcast(list(self.plain.parameters()))

    @register("rank_zero")
    def model_config(self) -> dict:
        """The model's Hugging Face config (what ``config.json`` of its checkpoint holds)."""
        return self.plain.config.to_hf_dict()


class ActorWorker(TrainableRole, ReferenceWorker):
    """The policy: generates through its rollout backend and trains with the configured policy loss.

    ``algorithm.policy_loss`` names a registered loss (``get_policy_loss``): ``ppo`` clips
    against ``old_logprobs``; ``decoupled`` clips against them as the proximal policy and
    weights each token by the truncated ratio to the rollout's ``behavior_logprobs``.
    """

    role = "actor"  # names its checkpoint files (optim_actor)
    tokenizer = None  # set by the builder; saved beside the weights so a checkpoint is a complete HF model

    def __init__(self, model: torch.nn.Module, rollout: RolloutBackend, device: torch.device, dtype: torch.dtype,
                 algo, trainer, temperature: float, norm_len: int, plain: torch.nn.Module | None = None):
        # ``plain``: the unsharded copy the rollout runs on when ``model`` is FSDP-sharded (see parallel.py).
        self.model, self.rollout, self.norm_len = model, rollout, norm_len
        self.plain = model if plain is None else plain
        self.device, self.dtype, self.temperature = device, dtype, temperature
        self.algo, self.cfg, self.mbs = algo, trainer, trainer.micro_batch_size
        self.policy_loss = get_policy_loss(algo.policy_loss)
        # Only trainable tensors: with LoRA the frozen base has no Adam moments (the optimizer state is the adapters').
        self.optimizer = adamw([p for p in model.parameters() if p.requires_grad], trainer.lr, trainer.weight_decay)

    @register("one_to_all", collect="rank_zero")
    def use_rollout(self, rollout: RolloutBackend) -> None:
        """Generate with ``rollout`` from now on (in-process: the pipelined rollout, which holds this
        worker's model and pushes its weights to its stage processes at each weight sync)."""
        self.rollout = rollout

    @register("dp_split")
    def generate(self, requests: list[RolloutRequest]) -> list[Sample]:
        """Generate a response for each request with the actor's rollout, returned in the requests' order."""
        samples = list(self.rollout.generate(requests))
        order = {r.uid: i for i, r in enumerate(requests)}
        return sorted(samples, key=lambda s: order[s.uid])

    @register("dp_split", collect="rank_zero")
    def update(self, batch: Batch, lr: float, kl_coef: float, seed: int) -> dict[str, float]:
        """Epochs of mini-batch policy-loss updates; gradients accumulate over micro-batches exactly.

        The loss of each micro-batch is normalised by its mini-batch's global token and
        sequence counts, so the accumulated gradient equals the whole mini-batch's. With
        ``dp`` ranks each takes ``mini_batch_size / dp`` rows of its shard per step, the
        counts are summed over ranks and so are the metrics (rank 0's copy is returned).
        """
        self.model.train()
        set_lr(self.optimizer, lr)
        algo, records = self.algo, []
        for idx in minibatches(len(batch), self.cfg.mini_batch_size // self.world_size, self.cfg.epochs, seed):
            mini = batch.select(idx)
            n_tok, n_seq = self.global_counts(mini["response_mask"])
            rec: dict[str, float] = {}
            for mb in train_microbatches(self, mini, self.token_budget, self.mbs, by_prompt=shares_prefix(self)):
                mb = mb.to(self.device)
                with autocast(self.device, self.dtype):
                    logp, entropy = response_logprobs(self.model, mb, self.temperature, with_entropy=True,
                                                      share_prefix=shares_prefix(self))
                loss, metrics = actor_loss(self.policy_loss, algo, logp, entropy, mb, kl_coef, n_tok, n_seq,
                                           self.norm_len)
                self.backward(loss)
                for k, v in metrics.items():
                    rec[k] = rec.get(k, 0.0) + v
            rec = self.all_reduce_sum(rec)
            self.reduce_replicated_grads()
            rec["actor/grad_norm"] = clipped_step(self.model, self.optimizer, self.cfg.grad_clip, "actor")
            records.append(rec)
        return mean_metrics(records)

    @register("one_to_all", collect="rank_zero")
    def save(self, ckpt_dir: str) -> None:
        """The model and optimizer (see ``TrainableRole.save``), plus the tokenizer beside the weights."""
        super().save(ckpt_dir)
        if self.rank == 0 and self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(Path(ckpt_dir) / self.role))

    @register("one_to_all", collect="rank_zero")
    def sync_weights(self, version: int) -> dict[str, float]:
        """Hand the updated weights to the rollout (in-process: shared, only the version moves; a backend
        with its own copy, vLLM, gets them pushed). Returns the backend's sync metrics (time, MB), if any."""
        self.sync_plain()
        self.rollout.update_weights(version)
        return dict(getattr(self.rollout, "sync_metrics", {}))
