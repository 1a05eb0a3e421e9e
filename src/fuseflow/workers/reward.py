"""Reward role: scores finished samples with the task's function and/or a learned reward model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fuseflow.controller.worker import Worker, register
from fuseflow.tasks import Prompt, Task

from .evaluation import HeldOut


@dataclass
class RewardOutput:
    """Per-sample signals of one scoring call, each (B,) float.

    scores:    what the advantages see: model_weight * rm_scores + fn_weight * fn_scores (NaN if non-finite)
    correct:   1 where the task function's reward reaches the task's success threshold
    fn_scores: the task's reward function (the hidden gold rule on the ``pref`` task); NaN
               when the task has none (a file task scored by the reward model alone)
    rm_scores: the learned reward model's standardised score, or None without one
    costs:     the task's cost (safe_ppo), or None when the task has none
    """

    scores: torch.Tensor
    correct: torch.Tensor
    fn_scores: torch.Tensor
    rm_scores: torch.Tensor | None = None
    costs: torch.Tensor | None = None


class RewardWorker(Worker):
    """Owns the task's reward (and cost) function and, when configured, a reward model.

    The reward model scores a list of finished samples in batches of its own size
    (``reward.batch_size``), independently of how they were generated. With ``reward.dp=k``
    (backend=ray) the group has k such workers, each with its own copy of the reward model,
    and every ``score`` call is split over them.
    """

    def __init__(self, task: Task, reward_model=None, fn_weight: float = 1.0, model_weight: float = 1.0):
        if not task.has_reward and (fn_weight or reward_model is None):
            raise ValueError(f"task {task.name!r} has no reward function, so the reward must come from a reward "
                             f"model alone (reward.model=DIR, reward.fn_weight=0; got fn_weight={fn_weight}, "
                             f"reward model {'set' if reward_model is not None else 'not set'})")
        self.task, self.model = task, reward_model
        self.fn_weight, self.model_weight = fn_weight, model_weight

    role = "reward"
    heldout: HeldOut | None = None  # set by the builder for preference_eval

    @register("rank_zero")
    def preference_eval(self, responses: list[str], sft_responses: list[str]) -> dict[str, float]:
        """Held-out RM score of the policy's sampled responses and the gold win rate over the SFT model's."""
        return self.heldout.preference(responses, sft_responses, self.model)

    # Samples are scored one by one and independently, so the group splits prompts and responses
    # together into contiguous runs (one per rank) and puts every RewardOutput field back in sample
    # order: k workers return what one would (reward-model scores up to float rounding, since its
    # batches are cut differently).
    @register("dp_split", split_args=2)
    def score(self, prompts: list[Prompt], responses: list[str]) -> RewardOutput:
        """Reward signals of finished samples, ``prompts[i]`` paired with ``responses[i]`` (see RewardOutput)."""
        fn = torch.tensor(self.task.score_many(prompts, responses), dtype=torch.float32)
        t = self.task.success_threshold
        correct = ((fn == fn) & (fn >= t)).float()
        # At weight 0 the task function is only logged (e.g. the hidden gold rule), so its NaN is ignored.
        scores = self.fn_weight * fn if self.fn_weight else torch.zeros_like(fn)
        rm = None
        if self.model is not None:
            rm = self.model.score([p.text for p in prompts], responses)
            scores = scores + self.model_weight * rm
        costs = None
        if self.task.has_cost:
            costs = torch.tensor(self.task.cost_many(prompts, responses), dtype=torch.float32)
        return RewardOutput(scores, correct, fn, rm, costs)
