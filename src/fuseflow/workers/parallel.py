"""What a trainable role needs to run data-parallel: global counts, gradient scale, full weights.

A role with ``dp > 1`` holds an FSDP2-sharded ``model`` (its optimizer steps the shards)
plus ``plain``, an unsharded copy on each rank used wherever one process needs the whole
model: the actor's rollout engine (generation lengths differ per rank, so it cannot meet
its peers in the per-layer all-gathers of a sharded forward), held-out evaluation and
checkpoints. With ``dp == 1`` there is no copy: ``plain`` is ``model``, and every helper
here is the identity, so the in-process path is unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fuseflow.algorithms import aggregation_counts
from fuseflow.checkpoint import save_optimizer_state
from fuseflow.controller.worker import Worker, register
from fuseflow.models.parallelize import copy_full_weights, full_optimizer_state


class TrainableRole(Worker):
    """Mixin for roles that own ``model``, ``plain`` and ``optimizer`` (actor, critic)."""

    model: torch.nn.Module
    plain: torch.nn.Module
    optimizer: torch.optim.Optimizer

    @property
    def sharded(self) -> bool:
        return self.plain is not self.model

    def global_counts(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, sequences) of one mini-batch over every rank: the denominators of ``aggregate``."""
        n_tok, n_seq = aggregation_counts(mask)
        return self.all_reduce_tensor(n_tok), self.all_reduce_tensor(n_seq)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a loss normalised by global counts; FSDP averages gradients, so undo its 1/dp."""
        (loss * self.world_size if self.sharded else loss).backward()

    def sync_plain(self) -> None:
        """Gather the trained shards into ``plain`` (a collective: all ranks call it together)."""
        if self.sharded:
            copy_full_weights(self.model, self.plain)

    @register("one_to_all", collect="rank_zero")
    def save(self, ckpt_dir: str) -> None:
        """Write ``<ckpt_dir>/<role>/`` (HF model) and ``optim_<role>.*`` as a single-process run does."""
        self.sync_plain()
        state = full_optimizer_state(self.optimizer) if self.sharded else self.optimizer.state_dict()
        if self.rank == 0:
            self.plain.save_pretrained(Path(ckpt_dir) / self.role)
            save_optimizer_state(state, Path(ckpt_dir) / f"optim_{self.role}")
