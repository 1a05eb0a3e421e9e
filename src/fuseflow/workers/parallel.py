"""What a trainable role needs to run data-parallel: global counts, gradient scale, full weights.

A role with ``dp > 1`` holds an FSDP2-sharded ``model`` (its optimizer steps the shards)
plus ``plain``, an unsharded copy on each rank used wherever one process needs the whole
model: the actor's rollout engine (generation lengths differ per rank, so it cannot meet
its peers in the per-layer all-gathers of a sharded forward), held-out evaluation and
checkpoints. With ``dp == 1`` there is no copy: ``plain`` is ``model``, and every helper
here is the identity, so the in-process path is unchanged.

A LoRA policy is not sharded: its trainable part is a few MB of adapters and every rank needs
the whole frozen base anyway (rollout, reference), so sharding would only add a second copy of
the base per rank. Each rank holds ``model`` (= ``plain``) whole and the adapters' gradients
are summed over ranks before each step (``reduce_replicated_grads``), as DDP does.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fuseflow.algorithms import aggregation_counts
from fuseflow.checkpoint import save_optimizer_state
from fuseflow.controller.worker import Worker, register
from fuseflow.models.lora import lora_spec, save_adapter
from fuseflow.models.parallelize import copy_full_weights, full_optimizer_state


class TrainableRole(Worker):
    """Mixin for roles that own ``model``, ``plain`` and ``optimizer`` (actor, critic)."""

    model: torch.nn.Module
    plain: torch.nn.Module
    optimizer: torch.optim.Optimizer
    base_path: Path | None = None  # a LoRA policy's base model directory, named in its saved adapter

    @property
    def sharded(self) -> bool:
        """True when ``model`` is an FSDP2-sharded copy beside the unsharded ``plain`` (``dp > 1``, not LoRA)."""
        return self.plain is not self.model

    def global_counts(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, sequences) of one mini-batch over every rank: the denominators of ``aggregate``."""
        n_tok, n_seq = aggregation_counts(mask)
        return self.all_reduce_tensor(n_tok), self.all_reduce_tensor(n_seq)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a loss normalised by global counts; FSDP averages gradients, so undo its 1/dp."""
        (loss * self.world_size if self.sharded else loss).backward()

    def reduce_replicated_grads(self) -> None:
        """Sum the trainable gradients over ranks for an unsharded model trained at dp > 1 (LoRA).

        Each rank's loss is normalised by the global counts, so the sum is the whole mini-batch's
        gradient and every rank takes the same step; one flat all-reduce for all adapters.
        """
        if self.sharded or not self.dist.distributed or self.world_size == 1:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self.all_reduce_tensor(torch.cat([g.reshape(-1) for g in grads]))
        for p, g in zip(params, flat.to(params[0].device).split([p.numel() for p in params]), strict=True):
            p.grad = g.view_as(p).clone()

    def sync_plain(self) -> None:
        """Gather the trained shards into ``plain`` (a collective: all ranks call it together)."""
        if self.sharded:
            copy_full_weights(self.model, self.plain)

    @register("rank_zero")
    def trained_state(self) -> dict:
        """The model's state dict, the optimizer's and the names of the parameters it steps (in its order):
        what a pipeline-parallel step (``schedule.pipeline.roles``) starts its stages from."""
        names = [n for n, p in self.plain.named_parameters() if p.requires_grad]
        return {"weights": self.plain.state_dict(), "optimizer": self.optimizer.state_dict(), "names": names}

    @register("one_to_all", collect="rank_zero")
    def load_trained(self, weights: dict[str, torch.Tensor], optimizer: dict) -> None:
        """Take the weights and optimizer state a pipeline-parallel step trained (``trained_state``'s layout).

        The weights are copied into the live tensors, so a rollout sharing them sees the update."""
        self.plain.load_state_dict(weights)
        self.optimizer.load_state_dict(optimizer)

    @register("one_to_all", collect="rank_zero")
    def save(self, ckpt_dir: str) -> None:
        """Write ``<ckpt_dir>/<role>/`` (HF model, or a LoRA policy's peft adapter) and ``optim_<role>.*`` as a single-process run does."""
        self.sync_plain()
        state = full_optimizer_state(self.optimizer) if self.sharded else self.optimizer.state_dict()
        if self.rank == 0:
            if lora_spec(self.plain) is not None:  # the adapters only; the base is the run's reference
                save_adapter(self.plain, Path(ckpt_dir) / self.role, self.base_path)
            else:
                self.plain.save_pretrained(Path(ckpt_dir) / self.role)
            save_optimizer_state(state, Path(ckpt_dir) / f"optim_{self.role}")
