"""Reward role: scores finished samples with the task's verifiable reward."""

from __future__ import annotations

import torch

from fuseflow.data.batch import Batch
from fuseflow.tasks import Prompt, Task


class RewardWorker:
    def __init__(self, task: Task):
        self.task = task

    def score(self, batch: Batch, prompts: list[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores (B,), correct (B,)) for the decoded responses; NaN marks a non-finite reward."""
        scores = [self.task.score(p, r) for p, r in zip(prompts, batch.meta["response"])]
        t = self.task.success_threshold
        correct = [s == s and s >= t for s in scores]
        return torch.tensor(scores, dtype=torch.float32), torch.tensor(correct, dtype=torch.float32)
